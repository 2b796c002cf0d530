//! A plain counter of body runs, for tests that need no per-key ledger.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::Error;

/// Counts how many times bodies ran.
///
/// ```
/// # async fn demo(idem: idem_core::Idempotency) {
/// let runs = idem_testkit::Runs::default();
/// let v: u32 = idem.call("charge", "k").run(|| runs.body(7)).await.unwrap();
/// assert_eq!((v, runs.get()), (7, 1));
/// # }
/// ```
#[derive(Debug, Default)]
pub struct Runs(AtomicUsize);

impl Runs {
    /// A body that succeeds with `v`; the run is counted when the body is
    /// made, that is when idem decides to run it.
    pub fn body<T>(&self, v: T) -> impl Future<Output = Result<T, Error>> + use<T> {
        self.record();
        async move { Ok(v) }
    }

    /// Counts one run, for bodies written out in the test.
    pub fn record(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// Runs counted so far.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}
