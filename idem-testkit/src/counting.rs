//! A real store that counts the round trips it is asked for, to prove
//! what a batch costs.

use async_trait::async_trait;
use idem_core::store::{
    Claim, ClaimReply, Finish, InvalidationSink, KeyWatch, RecordInfo, Rider, ScanPage, StepRecord,
    Store, Token, ValueKind, WriteReply,
};
use idem_core::{Durability, Error, Fingerprint};
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

    async fn complete(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner
            .complete(key, token, fingerprint, kind, value)
            .await
    }

    async fn complete_claim(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
        durability: Durability,
    ) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner
            .complete_claim(claim, kind, value, durability)
            .await
    }

    fn has_outbox(&self) -> bool {
        self.inner.has_outbox()
    }

    async fn complete_with_outbox(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
        messages: &[idem_core::outbox::OutboxMessage],
    ) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner
            .complete_with_outbox(key, token, fingerprint, kind, value, messages)
            .await
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

    async fn finish_batch_riding(
        &self,
        ops: &[Finish<'_>],
        rider: Rider,
    ) -> Vec<Result<WriteReply, Error>> {
        StoreCounts::add(&self.counts.finish_batches);
        self.inner.finish_batch_riding(ops, rider).await
    }

    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        self.inner.count_failure(key, ttl).await
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    // Every provided method is forwarded (a default would answer for the
    // wrapped store); the step writes are single round trips.
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.save_step(key, token, name, value).await
    }

    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.steps(key, token).await
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        StoreCounts::add(&self.counts.singles);
        self.inner.suspend(key, token).await
    }

    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        self.inner.inspect(key, with_value).await
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        self.inner.forget(key, force).await
    }

    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.inner.watch(key).await
    }

    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        self.inner.watch_forgotten(prefix, sink).await
    }

    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        self.inner.scan(prefix, cursor, count).await
    }
}
