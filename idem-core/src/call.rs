//! One idempotent call: claim, run the body under a kept-alive lease, then
//! store the result or release the key.

use crate::cache::Generation;
use crate::codec::{decode, encode, marker_error};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::hook::{CallOutcome, OutcomeEvent, Report, fire};
use crate::lease::Lease;
use crate::outcome::Outcome;
use crate::settings::{FailMode, Inner, validate_ttl_lease};
use crate::store::{Claim, ClaimReply, Completed, KeyWatch, Store, ValueKind, WriteReply};
use crate::token::Token;
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::{Future, poll_fn};
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::time::{Instant, Sleep, sleep, sleep_until, timeout};
use tracing::Instrument;
use tracing::field::Empty;

/// One call of an operation, configured then [`run`](Call::run).
///
/// Made by [`Idempotency::call`](crate::Idempotency::call). Holds no borrow
/// of the key or the fingerprint value: both are rendered at once.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let request = ("refund", 500, "EUR");
/// let r: Result<u64, idem_core::Error> = idem
///     .call("payments.refund", "order-9")
///     .ttl(Duration::from_secs(3600))
///     .lease(Duration::from_secs(10))
///     .fingerprint(&request)
///     .wait(Duration::from_secs(5))
///     .run(|| async { Ok(500) })
///     .await;
/// assert_eq!(r.unwrap(), 500);
/// # });
/// ```
#[must_use = "a Call does nothing until `.run(..)` is awaited"]
pub struct Call<'a> {
    inner: &'a Inner,
    scope: &'a str,
    key: Result<String, Error>,
    ttl: Duration,
    /// Set for this call; else the builder's, capped at the TTL.
    lease: Option<Duration>,
    wait: Option<Duration>,
    fingerprint: Result<Option<Fingerprint>, Error>,
    /// The body undoes its effects when dropped: a cancelled call releases.
    release_on_cancel: bool,
}

impl<'a> Call<'a> {
    pub(crate) fn new(inner: &'a Inner, scope: &'a str, key: Result<String, Error>) -> Call<'a> {
        Call {
            inner,
            scope,
            key,
            ttl: inner.result_ttl,
            lease: None,
            wait: inner.wait,
            fingerprint: Ok(None),
            release_on_cancel: false,
        }
    }

    /// How long this call's result is replayed (overrides the builder's `result_ttl`).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").ttl(std::time::Duration::from_secs(60));
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// This call's lease (overrides the builder's `lease`). Without it, a
    /// call whose [`ttl`](Call::ttl) is shorter than the builder's lease
    /// uses the TTL as its lease; with it, a lease over the TTL is refused
    /// with [`Error::InvalidConfig`].
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").lease(std::time::Duration::from_secs(5));
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// When another call holds the key, wait up to `wait` for its result (or
    /// take over if its holder dies) instead of failing at once with
    /// [`Error::InProgress`].
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").wait(std::time::Duration::from_secs(5));
    /// ```
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The request's payload: reusing the key with a different payload fails
    /// with [`Error::FingerprintMismatch`] instead of replaying a result that
    /// belongs to another request. Hashed now (canonical JSON, SHA-256).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let a: Result<u32, idem_core::Error> = idem.call("s", "k").fingerprint(&100).run(|| async { Ok(1) }).await;
    /// let b: Result<u32, idem_core::Error> = idem.call("s", "k").fingerprint(&200).run(|| async { Ok(2) }).await;
    /// assert!(matches!(b, Err(idem_core::Error::FingerprintMismatch)));
    /// # });
    /// ```
    pub fn fingerprint<F: Serialize + ?Sized>(mut self, value: &F) -> Self {
        self.fingerprint = Fingerprint::of(value).map(Some);
        self
    }

    /// Declares that this call's body undoes its effects when it is dropped
    /// half-way (a database transaction that rolls back on drop, say), so
    /// that a cancelled call releases its key at once and the next call
    /// runs the body as [`Outcome::Executed`].
    ///
    /// Without it, a call dropped after its body started (an aborted task,
    /// a `select!` that lost, a shutdown) keeps its key: the body may have
    /// made effects, so the key stays in flight, no longer renewed, until
    /// its lease ends, and the next call then runs the body as
    /// [`Outcome::Recovered`] (attempt 2), which a body can check to
    /// reconcile. A call dropped before its body started releases either way.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").release_on_cancel();
    /// # });
    /// ```
    pub fn release_on_cancel(mut self) -> Self {
        self.release_on_cancel = true;
        self
    }

    /// A fingerprint computed elsewhere (the HTTP layer hashes the request).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").fingerprint_raw(idem_core::Fingerprint::of_bytes(b"body"));
    /// ```
    pub fn fingerprint_raw(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Ok(Some(fingerprint));
        self
    }

    /// Runs `body` at most once for this key and returns its value, or the
    /// stored value of an earlier run.
    ///
    /// `Err` from the body releases the key (the next call runs again) and
    /// is returned as is. Idempotency failures arrive as `E::from(Error)`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let first: Result<Vec<u8>, idem_core::Error> = idem.call("s", "k").run(|| async { Ok(vec![]) }).await;
    /// let again: Result<Vec<u8>, idem_core::Error> = idem.call("s", "k").run(|| async { Ok(vec![1]) }).await;
    /// assert_eq!(again.unwrap(), Vec::<u8>::new()); // empty values replay too
    /// # });
    /// ```
    pub async fn run<F, Fut, T, E>(self, body: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        self.run_outcome(body).await.map(|(value, _)| value)
    }

    /// Like [`run`](Call::run), also saying whether the body ran.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use idem_core::Outcome;
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let (_, o) = idem.call("s", "k").run_outcome(|| async { Ok::<_, idem_core::Error>(()) }).await?;
    /// assert_eq!(o, Outcome::Executed);
    /// let (_, o) = idem.call("s", "k").run_outcome(|| async { Ok::<_, idem_core::Error>(()) }).await?;
    /// assert_eq!(o, Outcome::Replayed);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub async fn run_outcome<F, Fut, T, E>(self, body: F) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let span = tracing::info_span!(
            "idem.call",
            scope = self.scope,
            key = Empty,
            outcome = Empty,
            attempt = Empty
        );
        // Clocks are read for the hook and metrics only: with neither,
        // a call costs what it did before they existed.
        let (inner, scope) = (self.inner, self.scope);
        let call_start = inner.observing().then(Instant::now);
        let exec = match self.prepare(&span, call_start) {
            Ok(exec) => exec,
            Err(e) => {
                span.record("outcome", "refused");
                let _enter = span.enter();
                tracing::warn!(error = %e, "idempotent call refused before reaching the store");
                if let Some(start) = call_start {
                    observe(
                        inner,
                        scope,
                        None,
                        CallOutcome::of_error(&e),
                        None,
                        start,
                        None,
                    );
                }
                return Err(E::from(e));
            }
        };
        let result = exec.run(body).instrument(span).await;
        exec.finish();
        result
    }

    fn prepare(self, span: &tracing::Span, call_start: Option<Instant>) -> Result<Exec<'a>, Error> {
        let inner = self.inner;
        if let Some(msg) = &inner.config_error {
            return Err(Error::InvalidConfig(msg.clone()));
        }
        // A user who set only a TTL expects it to work: the builder's lease
        // (30 s by default) yields to it.
        let lease = self.lease.unwrap_or(inner.lease.min(self.ttl));
        validate_ttl_lease(self.ttl, lease).map_err(Error::InvalidConfig)?;
        let key = self.key?;
        let fingerprint = self.fingerprint?;
        if !span.is_disabled() {
            span.record("key", shown_key(inner, &key).as_str());
        }
        // A hit in the local cache needs no owner token and no clock: look
        // first, and draw them only for a call that goes to the store.
        let cached = inner.cache.as_ref().and_then(|c| c.get(&key));
        let (token, started) = match cached {
            Some(_) => (Token::UNUSED, None),
            None => (Token::random(), Some(Instant::now())),
        };
        // Before any store read: a forget heard after it keeps that read's
        // record out of the cache.
        let seen = inner
            .cache
            .as_ref()
            .map(|c| c.generation(&key))
            .unwrap_or_default();
        Ok(Exec {
            inner,
            scope: self.scope,
            call_start,
            report: Report::new(),
            store: &inner.store,
            key,
            cached,
            token,
            started,
            seen,
            ttl: self.ttl,
            lease,
            wait: self.wait,
            fingerprint,
            release_on_cancel: self.release_on_cancel,
        })
    }
}

/// The key as logs and hooks show it: in clear only with `log_keys`.
pub(crate) fn shown_key(inner: &Inner, key: &str) -> String {
    if inner.log_keys {
        key.to_owned()
    } else {
        key_digest(key)
    }
}

/// A short, stable digest that lets logs correlate a key without showing it.
fn key_digest(key: &str) -> String {
    let f = Fingerprint::of_bytes(key.as_bytes());
    let b = f.as_bytes();
    format!(
        "#{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5]
    )
}

/// Reports a finished call to the hook and the metrics.
fn observe(
    inner: &Inner,
    scope: &str,
    key: Option<&str>,
    outcome: CallOutcome,
    attempt: Option<u32>,
    start: Instant,
    body: Option<Duration>,
) {
    #[cfg(feature = "metrics")]
    inner
        .metrics
        .call(&inner.namespace, scope, outcome, inner.store.name());
    if let Some(hook) = &inner.hook {
        let shown = key.map(|k| shown_key(inner, k));
        let event = OutcomeEvent {
            namespace: &inner.namespace,
            scope,
            key: shown.as_deref(),
            outcome,
            attempt,
            elapsed: start.elapsed(),
            body,
        };
        fire(hook, &event);
    }
}

/// A prepared call: everything checked, a fresh owner token drawn.
struct Exec<'a> {
    inner: &'a Inner,
    scope: &'a str,
    /// When `run` started, read only when something observes calls.
    call_start: Option<Instant>,
    /// What the call ended with, once it has (for the hook and metrics).
    report: Report,
    store: &'a Arc<dyn Store>,
    key: String,
    token: Token,
    ttl: Duration,
    lease: Duration,
    wait: Option<Duration>,
    fingerprint: Option<Fingerprint>,
    /// The local cache's copy of the record, when it had one.
    cached: Option<Completed>,
    /// When the call started for the store (before its claim was sent).
    started: Option<Instant>,
    /// The local cache's invalidations before the first store read.
    seen: Generation,
    /// Whether a call dropped mid-body releases its key (see
    /// [`Call::release_on_cancel`]).
    release_on_cancel: bool,
}

impl Exec<'_> {
    /// Reports the call once, after all its store work: the hook never runs
    /// inside a round trip, and a slow hook delays only this caller.
    fn finish(&self) {
        let (Some(start), Some(outcome)) = (self.call_start, self.report.take_outcome()) else {
            return;
        };
        observe(
            self.inner,
            self.scope,
            Some(&self.key),
            outcome,
            self.report.get_attempt(),
            start,
            self.report.get_body(),
        );
    }

    async fn run<F, Fut, T, E>(&self, body: F) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        if let Some(hit) = &self.cached {
            return self.replay(hit).map_err(E::from);
        }
        // Capped so that an absurd wait (`Duration::MAX`) waits "forever"
        // instead of overflowing the clock.
        let give_up_at = self
            .wait
            .map(|w| Instant::now() + w.min(Duration::from_secs(100 * 365 * 86_400)));
        let mut poll = Duration::from_millis(5);
        // Subscribed to the key's changes on the first InProgress, if the
        // store can notify; held (and so subscribed) until the call ends.
        let mut watch: Option<KeyWatch> = None;
        let mut asked = false;
        loop {
            let sent = Instant::now();
            let reply = match self.claim().await {
                Ok(reply) => reply,
                Err(e) if self.inner.fail_mode == FailMode::Open && is_unavailable(&e) => {
                    return self.run_unprotected(body, e).await;
                }
                Err(e) => return Err(self.fail(e)),
            };
            match reply {
                ClaimReply::Acquired { attempt } => {
                    return self.execute(body, attempt, sent).await;
                }
                ClaimReply::Completed(record) => {
                    if let Some(cache) = &self.inner.cache {
                        cache.insert(&self.key, record.clone(), sent, self.seen);
                    }
                    return self.replay(&record).map_err(E::from);
                }
                ClaimReply::Mismatch => return Err(self.fail(Error::FingerprintMismatch)),
                ClaimReply::InProgress { retry_after } => {
                    let now = Instant::now();
                    match give_up_at {
                        Some(end) if now < end => {
                            if !asked {
                                asked = true;
                                watch = self.store.watch(&self.key).await;
                                if watch.is_some() {
                                    // Subscribed: read again, so a change
                                    // between the claim and the subscription
                                    // is not missed.
                                    poll = NOTIFIED_POLL;
                                    continue;
                                }
                            }
                            // Never past the holder's lease (it may have
                            // died, and no one will tell) or our deadline.
                            let nap = poll.min(retry_after).min(end - now);
                            match watch.as_mut().filter(|w| w.is_live()) {
                                // Woken by the holder's complete or release;
                                // the slow poll only covers a lost message.
                                Some(w) => {
                                    let _ = timeout(nap, w.changed()).await;
                                    poll = (poll * 2).min(NOTIFIED_POLL_MAX);
                                }
                                // Poll fast at first (most bodies are short).
                                None => {
                                    sleep(nap).await;
                                    poll = (poll * 2).min(Duration::from_millis(250));
                                }
                            }
                        }
                        _ => return Err(self.fail(Error::InProgress { retry_after })),
                    }
                }
            }
        }
    }

    fn fail<E: From<Error>>(&self, e: Error) -> E {
        self.report.outcome(CallOutcome::of_error(&e));
        let span = tracing::Span::current();
        span.record(
            "outcome",
            match e {
                Error::InProgress { .. } => "in_progress",
                Error::FingerprintMismatch => "mismatch",
                _ => "error",
            },
        );
        if !e.is_retryable() || is_unavailable(&e) {
            tracing::warn!(error = %e, "idempotent call failed");
        }
        E::from(e)
    }

    fn replay<T: DeserializeOwned>(&self, record: &Completed) -> Result<(T, Outcome), Error> {
        if let (Some(given), Some(stored)) = (&self.fingerprint, &record.fingerprint) {
            if given != stored {
                return Err(self.fail(Error::FingerprintMismatch));
            }
        }
        tracing::Span::current().record("outcome", "replayed");
        self.report.outcome(CallOutcome::Replayed);
        decode(record, self.inner.max_value_size)
            .map(|v| (v, Outcome::Replayed))
            .map_err(|e| self.fail(e))
    }

    /// Claims, re-sending with the same token when the store could not be
    /// reached: the script answers a re-sent claim as the same claim, so a
    /// claim that landed but whose reply was lost is not stranded.
    async fn claim(&self) -> Result<ClaimReply, Error> {
        // Before the first read that may enter the cache: a forget after
        // the read is then heard (one atomic load once registered).
        self.inner.hear_forgets().await;
        let claim = Claim {
            key: &self.key,
            token: &self.token,
            lease: self.lease,
            ttl: self.ttl,
            fingerprint: self.fingerprint.as_ref(),
            want_ttl_left: self.inner.cache.is_some(),
        };
        // Dropped while a claim is in flight: the claim may land anyway, so
        // release by token rather than leave the key to the lease.
        let mut guard = self.guard();
        let result = (|| self.store.claim(claim))
            .retry(store_backoff(self.inner.store_retries))
            .when(is_unavailable)
            .notify(|e, delay| tracing::debug!(error = %e, ?delay, "claim did not reach the store; re-sending"))
            .await;
        guard.armed = false;
        if result.is_err() {
            // The last attempt may have landed after all: free the key now
            // rather than leaving it to the lease. Best effort.
            let _ = self.store.release(&self.key, &self.token).await;
        }
        result
    }

    async fn run_unprotected<F, Fut, T, E>(&self, body: F, cause: Error) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        tracing::warn!(error = %cause, "store unavailable and FailMode::Open: running the body WITHOUT idempotency protection");
        tracing::Span::current().record("outcome", "unprotected");
        let result = body().await;
        self.report.outcome(match result {
            Ok(_) => CallOutcome::Unprotected,
            Err(_) => CallOutcome::BodyError,
        });
        result.map(|v| (v, Outcome::Unprotected))
    }

    /// Runs the body under the lease claimed by a claim sent at `claimed`.
    async fn execute<F, Fut, T, E>(
        &self,
        body: F,
        attempt: u32,
        claimed: Instant,
    ) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let span = tracing::Span::current();
        span.record("attempt", attempt);
        let outcome = if attempt > 1 {
            tracing::warn!(
                attempt,
                "took over a key whose holder stopped renewing its lease; the body runs again"
            );
            Outcome::Recovered
        } else {
            Outcome::Executed
        };
        self.report.attempt(attempt);
        // Dropped mid-body, the call keeps its key (no longer renewed) until
        // the lease ends: the body may have made effects, and releasing would
        // let a redelivery run them again as `Executed`. Only a body declared
        // undone on drop releases at once.
        let mut guard = self.guard();
        guard.armed = self.release_on_cancel;
        let mut kept = KeptOnDrop {
            armed: !self.release_on_cancel,
        };
        let body_start = self.call_start.map(|_| Instant::now());
        #[cfg(feature = "metrics")]
        let in_flight = crate::metrics::InFlight::start(&self.inner.metrics);
        let lease = Lease::default();
        let body = crate::lease::scope(lease.clone(), AssertUnwindSafe(body()).catch_unwind());
        let result = self.keep_alive(body, &lease, claimed).await;
        #[cfg(feature = "metrics")]
        drop(in_flight);
        if let Some(body_start) = body_start {
            let took = body_start.elapsed();
            self.report.body(took);
            #[cfg(feature = "metrics")]
            self.inner.metrics.body(self.scope, took);
        }
        // From here on the body has finished: whatever happens to this
        // future, the key is never released on the way out.
        guard.armed = false;
        kept.armed = false;
        match result {
            Err(panic) => {
                self.release("the body panicked").await;
                self.report.outcome(CallOutcome::BodyError);
                self.finish();
                std::panic::resume_unwind(panic)
            }
            Ok(Err(e)) => {
                span.record("outcome", "released");
                self.release("the body returned an error").await;
                self.report.outcome(CallOutcome::BodyError);
                Err(e)
            }
            Ok(Ok(value)) => {
                let outcome = match self.complete(&value).await {
                    Stored::Yes => outcome,
                    Stored::LeaseLost => Outcome::LeaseLost,
                    Stored::No => Outcome::NotStored,
                };
                span.record("outcome", outcome.as_str());
                self.report.outcome(CallOutcome::from(outcome));
                Ok((value, outcome))
            }
        }
    }

    fn guard(&self) -> ReleaseGuard<'_> {
        ReleaseGuard {
            store: self.store,
            key: &self.key,
            token: &self.token,
            armed: true,
        }
    }

    async fn release(&self, why: &str) {
        match self.store.release(&self.key, &self.token).await {
            Ok(WriteReply::Done) => tracing::debug!("{why}: key released"),
            Ok(other) => tracing::warn!(?other, "{why}, but the key was no longer ours to release"),
            Err(e) => {
                tracing::warn!(error = %e, "{why}, and the key could not be released: it frees itself when the lease expires")
            }
        }
    }

    /// Stores the result, re-trying within the lease. The work has happened
    /// either way, so this never turns a success into an error; and if this
    /// future is dropped meanwhile (the caller gave up), the completion
    /// goes on in a task of its own rather than leave the key to run again.
    async fn complete<T: Serialize>(&self, value: &T) -> Stored {
        let encoded = encode(value, self.inner.max_value_size, self.inner.compress_above);
        if let Some(problem) = marker_error(encoded.kind, &encoded.bytes) {
            tracing::warn!(error = %problem, "the result is returned but cannot be stored; later calls with this key get this error instead of running the body again");
        }
        let value: Bytes = encoded.bytes.into();
        let completion = Completion {
            store: self.store,
            key: &self.key,
            token: self.token,
            fingerprint: self.fingerprint,
            kind: encoded.kind,
            value: &value,
            lease: self.lease,
        };
        let mut detach = DetachOnDrop(Some(&completion));
        let stored = completion.run().await;
        detach.0 = None;
        drop(detach);
        if stored == Stored::Yes {
            if let (Some(cache), Some(started)) = (&self.inner.cache, self.started) {
                let record = Completed {
                    kind: encoded.kind,
                    value: value.clone(),
                    fingerprint: self.fingerprint,
                    // The record's TTL runs from the claim, sent after this.
                    ttl_left: Some(self.ttl),
                };
                cache.insert(&self.key, record, started, self.seen);
            }
        }
        stored
    }

    /// Drives `body`, renewing the lease about every third of it from inside
    /// this future: no detached task, so a holder that is no longer polled
    /// (frozen process, forgotten future) stops renewing and loses the key.
    ///
    /// Flags `lease` lost when the store answers that the record is no
    /// longer ours, or when no renewal has been confirmed for a whole lease
    /// (counted from when the confirmed claim or renewal was sent, so never
    /// later than the store's own count): past that the store may give the
    /// key to another caller. Renewals go on after the latter, as the store
    /// may still answer that the key is ours.
    async fn keep_alive<Fut: Future>(
        &self,
        body: Fut,
        lease: &Lease,
        claimed: Instant,
    ) -> Fut::Output {
        let period = self.lease / 3;
        let mut body = pin!(body);
        let mut tick: Option<Pin<Box<Sleep>>> = None;
        let mut renewing: Option<(Instant, BoxFuture<'_, Result<WriteReply, Error>>)> = None;
        let mut valid_until = claimed + self.lease;
        // Both timers are made on the first pending poll: most bodies are
        // done by then and never pay for them.
        let mut expiry: Option<Pin<Box<Sleep>>> = None;
        let mut refused = false;
        poll_fn(|cx| {
            if let Poll::Ready(out) = body.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            while !refused {
                if let Some((sent, renewal)) = renewing.as_mut() {
                    let sent = *sent;
                    let Poll::Ready(result) = renewal.as_mut().poll(cx) else {
                        break;
                    };
                    renewing = None;
                    let next = match result {
                        Ok(WriteReply::Done) => {
                            valid_until = sent + self.lease;
                            if let Some(e) = expiry.as_mut() {
                                e.as_mut().reset(valid_until);
                            }
                            period
                        }
                        Ok(other) => {
                            refused = true;
                            lease.mark_lost();
                            tracing::error!(
                                ?other,
                                "lease lost while the body runs: another caller may take over"
                            );
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "lease renewal failed; retrying sooner");
                            period / 3
                        }
                    };
                    if let Some(t) = tick.as_mut() {
                        t.as_mut().reset(Instant::now() + next);
                    }
                }
                let t = tick.get_or_insert_with(|| Box::pin(sleep(period)));
                if t.as_mut().poll(cx).is_pending() {
                    break;
                }
                let sent = Instant::now();
                renewing = Some((sent, self.store.extend(&self.key, &self.token, self.lease)));
            }
            if !lease.is_lost() {
                let e = expiry.get_or_insert_with(|| Box::pin(sleep_until(valid_until)));
                if e.as_mut().poll(cx).is_ready() {
                    lease.mark_lost();
                    tracing::error!(
                        lease = ?self.lease,
                        "no lease renewal confirmed for a whole lease (store unreachable?): another caller may take over while the body runs"
                    );
                }
            }
            Poll::Pending
        })
        .await
    }
}

/// Whether a finished body's result made it into the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Yes,
    /// The record was no longer ours: taken over, or expired.
    LeaseLost,
    /// The store could not be reached within the retry window.
    No,
}

/// Everything a `complete` needs, borrowed from the call; `to_owned` for a
/// completion that outlives it.
struct Completion<'a> {
    store: &'a Arc<dyn Store>,
    key: &'a str,
    token: Token,
    fingerprint: Option<Fingerprint>,
    kind: ValueKind,
    value: &'a Bytes,
    lease: Duration,
}

impl Completion<'_> {
    /// Sends `complete`, re-sending while the store is unreachable, for at
    /// most half a lease: past the lease the key may be taken over anyway.
    /// A re-sent complete that finds its own result stored is `Done`.
    async fn run(&self) -> Stored {
        let retries = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(20))
            .with_max_delay(self.lease / 4)
            .with_total_delay(Some(self.lease / 2))
            .without_max_times();
        let result = (|| {
            self.store.complete(
                self.key,
                &self.token,
                self.fingerprint.as_ref(),
                self.kind,
                self.value,
            )
        })
        .retry(retries)
        .when(is_unavailable)
        .await;
        match result {
            Ok(WriteReply::Done) => Stored::Yes,
            Ok(other) => {
                tracing::error!(
                    ?other,
                    "the body finished after its lease was lost (it blocked or was not polled for longer than the lease): another caller may have run it too; this result was NOT stored"
                );
                Stored::LeaseLost
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "the result could not be stored; the key stays in flight until its lease expires, then the next call runs the body again"
                );
                Stored::No
            }
        }
    }
}

/// Finishes a [`Completion`] in a task of its own when the call's future
/// is dropped while it runs: the body has succeeded, so dropping the
/// caller must neither release the key nor leave it to run again.
struct DetachOnDrop<'a>(Option<&'a Completion<'a>>);

impl Drop for DetachOnDrop<'_> {
    fn drop(&mut self) {
        let Some(c) = self.0.take() else {
            return;
        };
        let (store, key, value) = (Arc::clone(c.store), c.key.to_owned(), c.value.clone());
        let (token, fingerprint, kind, lease) = (c.token, c.fingerprint, c.kind, c.lease);
        let finish = async move {
            let completion = Completion {
                store: &store,
                key: &key,
                token,
                fingerprint,
                kind,
                value: &value,
                lease,
            };
            if completion.run().await == Stored::Yes {
                tracing::debug!(
                    "call dropped after its body succeeded: result stored by a detached completion"
                );
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(finish.instrument(tracing::Span::current()));
            }
            Err(_) => tracing::warn!(
                "call dropped outside a Tokio runtime after its body succeeded: the result is not stored; the key runs again after its lease"
            ),
        }
    }
}

/// Says, when a call's future is dropped mid-body without releasing (see
/// [`Call::release_on_cancel`]), why the key stays in flight.
struct KeptOnDrop {
    armed: bool,
}

impl Drop for KeptOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tracing::warn!(
                "call dropped mid-body: the body may have made effects, so the key stays in flight until its lease ends; the next call then runs the body again as Recovered"
            );
        }
    }
}

/// Releases the claim if the call's future is dropped while its claim is
/// in flight, or mid-body under [`Call::release_on_cancel`]: at once, by
/// owner token, rather than after the lease.
struct ReleaseGuard<'a> {
    store: &'a Arc<dyn Store>,
    key: &'a str,
    token: &'a Token,
    armed: bool,
}

impl Drop for ReleaseGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, key, token) = (Arc::clone(self.store), self.key.to_owned(), *self.token);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    match store.release(&key, &token).await {
                        Ok(_) => tracing::debug!("call cancelled: key released"),
                        Err(e) => tracing::warn!(error = %e, "call cancelled and the key could not be released: it frees itself when the lease expires"),
                    }
                });
            }
            Err(_) => tracing::warn!(
                "call cancelled outside a Tokio runtime: the key frees itself when the lease expires"
            ),
        }
    }
}

fn is_unavailable(e: &Error) -> bool {
    matches!(e, Error::Unavailable { .. })
}

/// How often a waiter reads the record while the store notifies it: only
/// to cover a lost message (pub/sub is at most once), so slowly; doubled
/// up to [`NOTIFIED_POLL_MAX`]. Without notifications: 5 ms doubling to
/// 250 ms, as most bodies are short.
const NOTIFIED_POLL: Duration = Duration::from_millis(500);
const NOTIFIED_POLL_MAX: Duration = Duration::from_secs(2);

fn store_backoff(retries: usize) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(200))
        .with_jitter()
        .with_max_times(retries)
}
