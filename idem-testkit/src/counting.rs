//! A real store that counts the round trips it is asked for, to prove
//! what a batch costs.

use async_trait::async_trait;
use idem_core::Error;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, Finish, StepRecord, StepStore, Store, Token,
    WriteReply,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Wraps a store and counts its calls by kind; every call goes through to
/// the real store.
///
/// ```
/// use idem_core::{Batch, Idempotency, MemoryStore};
/// use idem_testkit::CountingStore;
/// // One thread: the bodies finish together, so their results go in one
/// // finish batch (on several threads a straggler may make a second).
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = CountingStore::new(MemoryStore::new());
/// let counts = store.counts();
/// let idem = Idempotency::builder(store).build();
/// let batch: Batch = (0..8).map(|k| idem.call("s", k)).collect();
/// batch.run(|i| async move { Ok::<_, idem_core::Error>(i) }).await;
/// assert_eq!((counts.claim_batches(), counts.finish_batches(), counts.singles()), (1, 1, 0));
/// # });
/// ```
pub struct CountingStore<S> {
    inner: S,
    counts: Arc<StoreCounts>,
    claim_delay: Duration,
    lost_claim_replies: Vec<String>,
}

/// What a [`CountingStore`] was asked, shared with the test.
#[derive(Debug, Default)]
pub struct StoreCounts {
    singles: AtomicUsize,
    claim_batches: AtomicUsize,
    finish_batches: AtomicUsize,
}

impl StoreCounts {
    /// Single `claim`, `complete` and `release` calls.
    pub fn singles(&self) -> usize {
        self.singles.load(Ordering::SeqCst)
    }

    /// `claim_batch` calls.
    pub fn claim_batches(&self) -> usize {
        self.claim_batches.load(Ordering::SeqCst)
    }

    /// `finish_batch` calls.
    pub fn finish_batches(&self) -> usize {
        self.finish_batches.load(Ordering::SeqCst)
    }

    fn add(n: &AtomicUsize) {
        n.fetch_add(1, Ordering::SeqCst);
    }
}

impl<S: Store> CountingStore<S> {
    /// Counts the calls made to `inner`.
    pub fn new(inner: S) -> CountingStore<S> {
        CountingStore {
            inner,
            counts: Arc::default(),
            claim_delay: Duration::ZERO,
            lost_claim_replies: Vec::new(),
        }
    }

    /// Holds every `claim_batch` for `delay` before it goes to the real
    /// store: a slow path to the store, on which a call dropped meanwhile
    /// sends whatever it sends next while its claim is still on the way.
    ///
    /// ```
    /// use idem_testkit::CountingStore;
    /// let store = CountingStore::new(idem_core::MemoryStore::new())
    ///     .delay_claim_batches(std::time::Duration::from_millis(300));
    /// # let _ = store;
    /// ```
    pub fn delay_claim_batches(mut self, delay: Duration) -> CountingStore<S> {
        self.claim_delay = delay;
        self
    }

    /// Loses the reply of every batched claim whose store key ends with
    /// `suffix`: the claim lands in the real store, and the caller gets
    /// [`Error::Unavailable`] instead of its reply, as when a connection
    /// drops between the claim's write and its answer.
    ///
    /// ```
    /// use idem_testkit::CountingStore;
    /// let store = CountingStore::new(idem_core::MemoryStore::new()).lose_claim_replies(":lost");
    /// # let _ = store;
    /// ```
    pub fn lose_claim_replies(mut self, suffix: &str) -> CountingStore<S> {
        self.lost_claim_replies.push(suffix.to_owned());
        self
    }

    /// The counts, to read after the store has moved into a runtime.
    pub fn counts(&self) -> Arc<StoreCounts> {
        Arc::clone(&self.counts)
    }
}

#[async_trait]
impl<S: Store> Store for CountingStore<S> {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.claim(claim).await
    }

    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.complete(complete).await
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.release(key, token).await
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.inner.extend(key, token, lease).await
    }

    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        StoreCounts::add(&self.counts.claim_batches);
        if !self.claim_delay.is_zero() {
            tokio::time::sleep(self.claim_delay).await;
        }
        let mut replies = self.inner.claim_batch(claims).await;
        for (claim, reply) in claims.iter().zip(replies.iter_mut()) {
            if self
                .lost_claim_replies
                .iter()
                .any(|suffix| claim.key.ends_with(suffix.as_str()))
            {
                *reply = Err(Error::unavailable(
                    "claim",
                    "the claim's reply was lost on its way back (a fault of the test's store)",
                ));
            }
        }
        replies
    }

    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        StoreCounts::add(&self.counts.finish_batches);
        self.inner.finish_batch(ops).await
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    /// The wrapped store's capabilities; steps through this wrapper, which
    /// counts their round trips.
    fn capabilities(&self) -> Capabilities<'_> {
        let mut caps = self.inner.capabilities();
        if caps.steps.is_some() {
            caps = caps.steps(self);
        }
        caps
    }
}

/// The step round trips are single round trips, counted as such.
#[async_trait]
impl<S: Store> StepStore for CountingStore<S> {
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner_steps()?.save_step(key, token, name, value).await
    }

    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner_steps()?.steps(key, token).await
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner_steps()?.suspend(key, token).await
    }
}

impl<S: Store> CountingStore<S> {
    /// The wrapped store's steps (named only when it has them).
    fn inner_steps(&self) -> Result<&dyn StepStore, Error> {
        self.inner
            .capabilities()
            .steps
            .ok_or(Error::Unsupported { op: "save_step" })
    }
}
