//! The broker-agnostic core: one message (or a batch) through idem, and the
//! decision that follows.

use crate::decision::{AllRetryable, Classify, DeadLetterReason, Decision, ErrorClass};
use crate::message::{KeySource, Message};
use idem_core::{Error, Idempotency, Outcome, Steps};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::Instrument;
use tracing::field::Empty;

/// The default [`Consumer::max_deliveries`]: far above any retry limit, so
/// that only a message that never gets through its handler reaches it.
pub const DEFAULT_MAX_DELIVERIES: u32 = 100;

const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// What happened to one message: the decision for the broker, and what idem
/// did.
///
/// ```
/// use idem_consumer::{Consumer, Message};
/// use idem_core::{Error, Idempotency, MemoryStore, Outcome};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders.charge");
/// let charge = |m: Message| async move { Ok::<_, Error>(m.payload().len()) };
/// let msg = Message::new(r#"{"amount":500}"#).with_id("m-1");
/// let first = consumer.handle(&msg, &charge).await;
/// let again = consumer.handle(&msg, &charge).await; // a redelivery
/// assert_eq!(first.outcome, Some(Outcome::Executed));
/// assert_eq!(again.outcome, Some(Outcome::Replayed));
/// assert_eq!((again.value, again.decision.is_ack()), (Some(14), true));
/// # });
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Handled<T> {
    /// What the adapter tells the broker.
    pub decision: Decision,
    /// What idem did, when the call reached it: `Executed` (the handler ran),
    /// `Replayed` (a duplicate: the stored result), `Recovered`, …
    pub outcome: Option<Outcome>,
    /// The handler's value (run now, or replayed).
    pub value: Option<T>,
    /// The idempotency key, when one could be made.
    pub key: Option<String>,
    /// In a batch: the index of an earlier copy of this message (same key
    /// and payload) that was handled instead of this one.
    pub duplicate_of: Option<usize>,
}

impl<T> Handled<T> {
    pub(crate) fn decided(decision: Decision, key: Option<String>) -> Handled<T> {
        Handled {
            decision,
            outcome: None,
            value: None,
            key,
            duplicate_of: None,
        }
    }
}

/// Why the body of an idem call did not return a value.
pub(crate) enum Failure<E> {
    Idem(Error),
    Handler(E),
    /// The broker-delivery valve was passed: the body declines to run, so
    /// the key is released untouched (a completed key still replays and
    /// acks).
    OverValve,
}

impl<E> From<Error> for Failure<E> {
    fn from(e: Error) -> Self {
        Failure::Idem(e)
    }
}

/// Runs message handlers through idem and decides ack / nack / dead-letter.
///
/// `C` classifies handler errors ([`AllRetryable`] by default; any
/// `Fn(&E) -> ErrorClass`, or [`ByTrait`](crate::ByTrait)).
///
/// ```
/// use idem_consumer::{Consumer, Decision, ErrorClass, Message};
/// use idem_core::{Idempotency, MemoryStore, Outcome};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).namespace("orders").build();
/// let consumer = Consumer::new(idem, "orders.charge")
///     .max_failures(5)
///     .classify(|e: &String| ErrorClass::from_retryable(!e.starts_with("declined")));
///
/// let charge = |m: Message| async move {
///     let order: serde_json::Value = m.json().map_err(|e| e.to_string())?;
///     Ok::<u64, String>(order["amount"].as_u64().unwrap_or(0))
/// };
/// let msg = Message::new(r#"{"order":"o-1","amount":500}"#).with_id("o-1");
/// let first = consumer.handle(&msg, &charge).await;
/// let again = consumer.handle(&msg.clone().with_delivery_count(2), &charge).await;
/// assert_eq!((first.decision, first.outcome), (Decision::Ack, Some(Outcome::Executed)));
/// assert_eq!((again.decision, again.outcome), (Decision::Ack, Some(Outcome::Replayed)));
/// # });
/// ```
#[derive(Clone)]
pub struct Consumer<C = AllRetryable> {
    idem: Idempotency,
    scope: Arc<str>,
    keys: KeySource,
    fingerprint: bool,
    max_failures: u32,
    max_deliveries: u32,
    backoff_initial: Duration,
    backoff_max: Duration,
    wait: Option<Duration>,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    concurrency: usize,
    drain_timeout: Duration,
    classifier: Arc<C>,
    /// The `process` span continues the producer's trace (else links it).
    trace_parent: bool,
    /// Set once the store said it cannot count failures (warned once).
    warned_uncounted: Arc<AtomicBool>,
}

impl<C> fmt::Debug for Consumer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("scope", &self.scope)
            .field("keys", &self.keys)
            .field("max_failures", &self.max_failures)
            .field("max_deliveries", &self.max_deliveries)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl Consumer<AllRetryable> {
    /// A consumer running handlers through `idem` under `scope` (the name of
    /// the operation, part of every key: one per kind of message handled).
    ///
    /// Defaults: keys from the message id or else the payload, payload
    /// fingerprints on, 5 handler failures at most, a valve of
    /// [`DEFAULT_MAX_DELIVERIES`] broker deliveries, backoff 500 ms doubling
    /// to 30 s, no waiting for in-flight duplicates, 16 messages at a time
    /// in a batch, every handler error retryable.
    pub fn new(idem: Idempotency, scope: &str) -> Consumer<AllRetryable> {
        Consumer {
            idem,
            scope: Arc::from(scope),
            keys: KeySource::default(),
            fingerprint: true,
            max_failures: 5,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            wait: None,
            ttl: None,
            lease: None,
            concurrency: 16,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            classifier: Arc::new(AllRetryable),
            trace_parent: false,
            warned_uncounted: Arc::default(),
        }
    }
}

impl<C> Consumer<C> {
    /// Where keys come from (default [`KeySource::IdOrPayload`]).
    pub fn keys(mut self, keys: KeySource) -> Self {
        self.keys = keys;
        self
    }

    /// Whether to fingerprint payloads (default on): a message id reused
    /// for another payload is then dead-lettered instead of acked as a
    /// duplicate. Turn it off when producers legitimately re-send an id with
    /// changed content (and exclude the changing fields instead where you can).
    pub fn fingerprint(mut self, on: bool) -> Self {
        self.fingerprint = on;
        self
    }

    /// Handler failures before a message that keeps failing is
    /// dead-lettered with [`DeadLetterReason::MaxFailures`] (default 5; at
    /// least 1).
    ///
    /// A failure is a run of the handler that returned a retryable error.
    /// They are counted per key in idem's store
    /// ([`Idempotency::count_failure`]), so they add up across consumers,
    /// processes and restarts, and nothing else counts: a delivery to a
    /// consumer killed before or during the handler, or one nacked because
    /// a duplicate was in flight, spends none of them. With a store that
    /// cannot count ([`idem_core::Error::Unsupported`]) the broker's delivery
    /// count stands in, as it did before failures were counted.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let consumer = idem_consumer::Consumer::new(idem, "orders.charge").max_failures(3);
    /// assert_eq!(consumer.failure_limit(), 3);
    /// ```
    pub fn max_failures(mut self, n: u32) -> Self {
        self.max_failures = n.max(1);
        self
    }

    /// The safety valve for delivery loops that never reach the end of the
    /// handler (default [`DEFAULT_MAX_DELIVERIES`]; at least 1): a delivery
    /// whose broker count is over `n` does not run the handler and is
    /// dead-lettered with [`DeadLetterReason::MaxDeliveries`] — unless its
    /// work is done, which is acked at any count.
    ///
    /// This is not the retry limit ([`max_failures`](Consumer::max_failures)
    /// is): broker deliveries also count crashes of the consumer and nacks
    /// of in-flight duplicates, so keep it well above `max_failures`, or a
    /// crash loop dead-letters valid messages that never ran. It stops a
    /// message that kills its consumer every time (out of memory, abort)
    /// from looping for ever.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// Nack delays: `initial` after the first failed delivery, doubling up
    /// to `max` (defaults 500 ms and 30 s).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max.max(initial);
        self
    }

    /// Wait up to `d` for a duplicate that another consumer is running, then
    /// ack with its result, instead of nacking at once.
    pub fn wait(mut self, d: Duration) -> Self {
        self.wait = Some(d);
        self
    }

    /// How long results (and so duplicate detection) last; default the
    /// runtime's `result_ttl`. Keep it longer than the broker's redelivery
    /// horizon.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The lease of each message's call; default the runtime's `lease`.
    /// A host that stops its handlers at a known instant (an AWS Lambda
    /// invocation's deadline) bounds it by the time left, so that a claim
    /// made by a stopped handler does not hold the key long after it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use std::time::Duration;
    /// let c = idem_consumer::Consumer::new(idem, "s").lease(Duration::from_secs(5));
    /// assert_eq!(c.call_lease(), Duration::from_secs(5));
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The lease of each message's call ([`lease`](Consumer::lease), or
    /// else the runtime's).
    pub fn call_lease(&self) -> Duration {
        self.lease.unwrap_or_else(|| self.idem.lease())
    }

    /// How long [`Adapter::run`](crate::Adapter::run) lets the handlers in
    /// flight finish after its shutdown signal before it abandons them
    /// (default 20 s: inside the 30 s grace period that Kubernetes and
    /// systemd give by default, with time left to settle). An abandoned
    /// handler's key stays held until its lease runs out, and its message
    /// comes back as [`Outcome::Recovered`]: keep the deadline longer than
    /// your handlers usually take.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use std::time::Duration;
    /// let c = idem_consumer::Consumer::new(idem, "s").drain_timeout(Duration::from_secs(5));
    /// assert_eq!(c.drain_deadline(), Duration::from_secs(5));
    /// ```
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout = d;
        self
    }

    /// Messages of one batch handled at once (default 16; at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// With the `otel` feature, whether a message's `process` span
    /// continues the producer's trace as its child (`true`) instead of
    /// linking to the producer's `create` span (`false`, the default, as
    /// the OpenTelemetry messaging conventions advise: a redelivered
    /// message is handled in several traces, a batch comes from many). Turn
    /// it on to see one trace from the request to the handler, for
    /// single-message handling.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let c = idem_consumer::Consumer::new(idem, "orders").continue_trace(true);
    /// ```
    pub fn continue_trace(mut self, on: bool) -> Self {
        self.trace_parent = on;
        self
    }

    /// How handler errors are classified.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use idem_consumer::{Consumer, ErrorClass};
    /// let c = Consumer::new(idem, "s").classify(|_: &std::io::Error| ErrorClass::Permanent);
    /// ```
    pub fn classify<C2>(self, classifier: C2) -> Consumer<C2> {
        Consumer {
            idem: self.idem,
            scope: self.scope,
            keys: self.keys,
            fingerprint: self.fingerprint,
            max_failures: self.max_failures,
            max_deliveries: self.max_deliveries,
            backoff_initial: self.backoff_initial,
            backoff_max: self.backoff_max,
            wait: self.wait,
            ttl: self.ttl,
            lease: self.lease,
            concurrency: self.concurrency,
            drain_timeout: self.drain_timeout,
            classifier: Arc::new(classifier),
            trace_parent: self.trace_parent,
            warned_uncounted: self.warned_uncounted,
        }
    }

    /// The idem runtime.
    pub fn idem(&self) -> &Idempotency {
        &self.idem
    }

    /// The scope every key is stored under.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The configured handler-failure limit
    /// ([`max_failures`](Consumer::max_failures)).
    pub fn failure_limit(&self) -> u32 {
        self.max_failures
    }

    /// The configured broker-delivery valve
    /// ([`max_deliveries`](Consumer::max_deliveries)).
    pub fn delivery_limit(&self) -> u32 {
        self.max_deliveries
    }

    /// How long a shutdown waits for handlers in flight
    /// ([`drain_timeout`](Consumer::drain_timeout)).
    pub fn drain_deadline(&self) -> Duration {
        self.drain_timeout
    }

    /// Messages handled at once in a batch.
    pub fn batch_concurrency(&self) -> usize {
        self.concurrency
    }

    /// How often adapters tell the broker a message is still being worked
    /// on: a third of idem's lease, the period of idem's own keep-alive.
    pub fn keep_alive_period(&self) -> Duration {
        self.call_lease() / 3
    }

    /// The key of `msg` under this consumer's key source.
    pub fn key_of(&self, msg: &Message) -> Result<String, crate::ConsumerError> {
        self.keys.key(msg)
    }

    /// `msg`'s key and fingerprint, the payload digested once.
    /// A single message's key, and its fingerprint only when calls are
    /// fingerprinted (a batch needs it anyway, to find copies).
    fn key_for_one(
        &self,
        msg: &Message,
    ) -> (
        Result<String, crate::ConsumerError>,
        Option<idem_core::Fingerprint>,
    ) {
        if self.fingerprint {
            let (key, fingerprint) = self.keys.key_and_fingerprint(msg);
            (key, Some(fingerprint))
        } else {
            (self.keys.key(msg), None)
        }
    }

    pub(crate) fn key_and_fingerprint_of(
        &self,
        msg: &Message,
    ) -> (Result<String, crate::ConsumerError>, idem_core::Fingerprint) {
        self.keys.key_and_fingerprint(msg)
    }

    /// The nack delay after the `delivery`-th delivery failed.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use std::time::Duration;
    /// let c = idem_consumer::Consumer::new(idem, "s").backoff(Duration::from_secs(1), Duration::from_secs(5));
    /// assert_eq!(c.backoff_for(1), Duration::from_secs(1));
    /// assert_eq!(c.backoff_for(3), Duration::from_secs(4));
    /// assert_eq!(c.backoff_for(40), Duration::from_secs(5));
    /// ```
    pub fn backoff_for(&self, delivery: u32) -> Duration {
        let doublings = delivery.saturating_sub(1).min(31);
        self.backoff_initial
            .saturating_mul(1u32 << doublings)
            .min(self.backoff_max)
    }

    /// Runs `handler` for `msg` at most once per key (a redelivery or a
    /// duplicate replays the stored result) and decides what the broker
    /// should do with it.
    ///
    /// The handler gets the message by value (a cheap clone: the payload is
    /// shared), so the future of a consumer loop stays `Send` and can be
    /// spawned; both `|m: Message| async move { … }` and
    /// `async |m: Message| -> Result<T, E> { … }` work.
    pub async fn handle<T, E, H, Fut>(&self, msg: &Message, handler: &H) -> Handled<T>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let (key, fingerprint) = self.key_for_one(msg);
        self.handle_keyed(msg, key, fingerprint, handler).await
    }

    /// Like [`handle`](Consumer::handle), for a handler made of durable
    /// steps: it runs under [`Call::run_steps`](idem_core::Call::run_steps),
    /// so a redelivery after a crash, or after a step failed, replays the
    /// steps that finished and runs the rest. The decision table is
    /// unchanged: the handler's `Err` is classified as `handle` classifies
    /// it (a step's error is the handler's error when it returns it).
    ///
    /// ```
    /// use idem_consumer::{Consumer, Message};
    /// use idem_core::{Error, Idempotency, MemoryStore, Steps};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders.ship");
    /// let handler = async |m: Message, s: &Steps| -> Result<String, Error> {
    ///     let label = s.step("label", async || Ok::<_, Error>(format!("label-{}", m.id().unwrap_or("?")))).await?;
    ///     s.step("notify", async || Ok::<_, Error>(())).await?;
    ///     Ok(label)
    /// };
    /// let msg = Message::new("{}").with_id("m-1");
    /// let handled = consumer.handle_steps(&msg, &handler).await;
    /// assert!(handled.decision.is_ack());
    /// # });
    /// ```
    pub async fn handle_steps<T, E, H>(&self, msg: &Message, handler: &H) -> Handled<T>
    where
        H: AsyncFn(Message, &Steps) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let span = self.message_span(msg);
        let handled = async {
            let (key, fingerprint) = self.key_for_one(msg);
            match self.call_of(msg, key, fingerprint) {
                Err(refused) => refused,
                Ok((key, call)) => {
                    let over_delivery_limit = self.over_delivery_limit(msg);
                    let result = call
                        .run_steps_outcome(async |s| {
                            if over_delivery_limit {
                                return Err(Failure::OverValve);
                            }
                            handler(msg.clone(), s).await.map_err(Failure::Handler)
                        })
                        .await;
                    self.judge(msg, key, result).await
                }
            }
        }
        .instrument(span.clone())
        .await;
        report(&span, &handled);
        handled
    }

    pub(crate) async fn handle_keyed<T, E, H, Fut>(
        &self,
        msg: &Message,
        key: Result<String, crate::ConsumerError>,
        fingerprint: Option<idem_core::Fingerprint>,
        handler: &H,
    ) -> Handled<T>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let span = self.message_span(msg);
        let handled = async {
            match self.call_of(msg, key, fingerprint) {
                Err(refused) => refused,
                Ok((key, call)) => {
                    let over_delivery_limit = self.over_delivery_limit(msg);
                    let result = call
                        .run_outcome(|| run_handler(handler, msg, over_delivery_limit))
                        .await;
                    self.judge(msg, key, result).await
                }
            }
        }
        .instrument(span.clone())
        .await;
        report(&span, &handled);
        handled
    }

    /// The span every message's handling runs in: with `otel`, the
    /// messaging conventions' `process` span, linked to (or, with
    /// [`continue_trace`](Consumer::continue_trace), continuing) the span
    /// that created the message.
    pub(crate) fn message_span(&self, msg: &Message) -> tracing::Span {
        // No subscriber takes INFO spans: no span, so nothing is recorded
        // into it (tracing's `log` feature, which a dependency may turn on,
        // would otherwise format its five fields for the `log` crate per
        // message).
        if !tracing::level_enabled!(tracing::Level::INFO) {
            return tracing::Span::none();
        }
        #[cfg(feature = "otel")]
        {
            let span = tracing::info_span!(
                "idem.consume",
                broker = msg.broker(),
                source = msg.source(),
                position = msg.position(),
                id = msg.id(),
                delivery = msg.delivery_count(),
                outcome = Empty,
                decision = Empty,
                otel.name = format!("process {}", msg.source()),
                otel.kind = "consumer",
                messaging.system = crate::otel::system(msg.broker()),
                messaging.operation.type = "process",
                messaging.operation.name = "process",
                messaging.destination.name = msg.source(),
                messaging.message.id = msg.id(),
            );
            let producer = idem_core::otel::remote_context(|n| msg.trace_header(n));
            idem_core::otel::link_or_parent(&span, producer, self.trace_parent);
            span
        }
        #[cfg(not(feature = "otel"))]
        {
            let _ = self.trace_parent;
            tracing::info_span!(
                "idem.consume",
                broker = msg.broker(),
                source = msg.source(),
                position = msg.position(),
                id = msg.id(),
                delivery = msg.delivery_count(),
                outcome = Empty,
                decision = Empty,
            )
        }
    }

    /// The idem call of `msg`, or the decision for a message that cannot
    /// have one (no key: dead-lettered unrun).
    pub(crate) fn call_of<T>(
        &self,
        msg: &Message,
        key: Result<String, crate::ConsumerError>,
        fingerprint: Option<idem_core::Fingerprint>,
    ) -> Result<(String, idem_core::Call<'_>), Handled<T>> {
        let key = usable_key(key)?;
        let call = self.call_for(msg, &key, fingerprint);
        Ok((key, call))
    }

    /// The idem call for `msg` under `key`, with this consumer's settings.
    /// Returned by value and built in place: a batch pushes it straight
    /// into its list, where a call carried in a `Result` was copied whole
    /// four times more per message.
    pub(crate) fn call_for(
        &self,
        msg: &Message,
        key: &str,
        fingerprint: Option<idem_core::Fingerprint>,
    ) -> idem_core::Call<'_> {
        // The runtime's own TTL when none is set: the same call, and one
        // chain of setters, which the compiler builds in place (each
        // `call = call.setter(..)` copied the whole call).
        let ttl = self.ttl.unwrap_or_else(|| self.idem.result_ttl());
        if let Some(lease) = self.lease {
            let call = self.idem.call(&self.scope, key).ttl(ttl).lease(lease);
            let call = match (self.fingerprint, fingerprint) {
                (false, _) => call,
                (true, Some(fp)) => call.fingerprint_raw(fp),
                (true, None) => call.fingerprint_raw(self.keys.fingerprint(msg)),
            };
            return match self.wait {
                Some(w) => call.wait(w),
                None => call,
            };
        }
        if !self.fingerprint {
            let call = self.idem.call(&self.scope, key).ttl(ttl);
            return match self.wait {
                Some(w) => call.wait(w),
                None => call,
            };
        }
        // A batch has hashed the payload already.
        let fp = fingerprint.unwrap_or_else(|| self.keys.fingerprint(msg));
        let call = self
            .idem
            .call(&self.scope, key)
            .fingerprint_raw(fp)
            .ttl(ttl);
        match self.wait {
            Some(w) => call.wait(w),
            None => call,
        }
    }

    /// Whether `msg` is past the delivery valve: its handler must not run.
    pub(crate) fn over_delivery_limit(&self, msg: &Message) -> bool {
        msg.delivery_count() > self.max_deliveries
    }

    /// The decision for `msg` once its idem call returned `result`.
    pub(crate) async fn judge<T, E>(
        &self,
        msg: &Message,
        key: String,
        result: Result<(T, Outcome), Failure<E>>,
    ) -> Handled<T>
    where
        E: fmt::Display,
        C: Classify<E>,
    {
        match self.judge_now(msg, key, result) {
            Judged::Now(handled) => handled,
            Judged::Count(retry) => self.judge_retry(retry).await,
        }
    }

    /// The decision for `msg`, when it needs no store round trip (all but
    /// a retryable handler failure, whose count the store keeps).
    pub(crate) fn judge_now<T, E>(
        &self,
        msg: &Message,
        key: String,
        result: Result<(T, Outcome), Failure<E>>,
    ) -> Judged<T>
    where
        E: fmt::Display,
        C: Classify<E>,
    {
        let deliveries = msg.delivery_count();
        let decision = match result {
            Ok((value, outcome)) => {
                if outcome.result_not_stored() {
                    // Acking is still right: the work is done, and a
                    // redelivery would only run it again.
                    tracing::warn!(outcome = %outcome, "handler ran but its result is not stored");
                }
                return Judged::Now(Handled {
                    decision: Decision::Ack,
                    outcome: Some(outcome),
                    value: Some(value),
                    key: Some(key),
                    duplicate_of: None,
                });
            }
            Err(Failure::OverValve) => Decision::DeadLetter {
                reason: DeadLetterReason::MaxDeliveries {
                    deliveries,
                    last_error: format!(
                        "delivery {deliveries} is over the valve of {} broker deliveries and \
                         the work is not done (does the consumer die on this message?); the \
                         handler was not run",
                        self.max_deliveries
                    ),
                },
            },
            Err(Failure::Handler(e)) => match self.classifier.classify(&e) {
                ErrorClass::Permanent => Decision::DeadLetter {
                    reason: DeadLetterReason::Permanent(e.to_string()),
                },
                ErrorClass::Retryable => {
                    return Judged::Count(Retry {
                        key,
                        deliveries,
                        last_error: e.to_string(),
                    });
                }
            },
            Err(Failure::Idem(e)) => self.decide_idem_error(e, deliveries),
        };
        Judged::Now(Handled::decided(decision, Some(key)))
    }

    /// The decision after a retryable handler failure, once it is counted.
    pub(crate) async fn judge_retry<T>(&self, retry: Retry) -> Handled<T> {
        let decision = self
            .after_failure(&retry.key, retry.deliveries, retry.last_error)
            .await;
        Handled::decided(decision, Some(retry.key))
    }

    /// Counts a retryable handler failure for `key` and decides between
    /// another try and the dead-letter queue.
    async fn after_failure(&self, key: &str, deliveries: u32, last_error: String) -> Decision {
        let ttl = self.ttl.unwrap_or_else(|| self.idem.result_ttl());
        let failures = match self.idem.count_failure(&self.scope, key, ttl).await {
            Ok(n) => n,
            Err(Error::Unsupported { .. }) => {
                if !self.warned_uncounted.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "this idempotency store cannot count handler failures: the broker's \
                         delivery count stands in for them, so deliveries that never ran the \
                         handler (crashes, in-flight duplicates) also count towards max_failures"
                    );
                }
                deliveries
            }
            Err(e) => {
                // Not counted, so no reason to give up on the message: it
                // comes back, and the next failure is counted.
                tracing::warn!(error = %e, "handler failed and its failure could not be counted; nacking");
                return Decision::Nack {
                    delay: self.backoff_for(deliveries),
                };
            }
        };
        if failures >= self.max_failures {
            return Decision::DeadLetter {
                reason: DeadLetterReason::MaxFailures {
                    failures,
                    last_error,
                },
            };
        }
        Decision::Nack {
            delay: self.backoff_for(failures),
        }
    }

    fn decide_idem_error(&self, e: Error, deliveries: u32) -> Decision {
        match e {
            Error::InProgress { retry_after } => Decision::Nack {
                // Come back when the holder's lease would have run out: by
                // then it has finished (replay) or died (take over).
                delay: retry_after.max(Duration::from_millis(10)),
            },
            Error::FingerprintMismatch => Decision::DeadLetter {
                reason: DeadLetterReason::FingerprintMismatch,
            },
            Error::InvalidKey(k) => Decision::DeadLetter {
                reason: DeadLetterReason::BadMessage(k.to_string()),
            },
            e @ (Error::Corrupt { .. } | Error::Codec { .. } | Error::TooLarge { .. }) => {
                Decision::DeadLetter {
                    reason: DeadLetterReason::Store(e.to_string()),
                }
            }
            e => {
                // Unavailable (nothing ran), configuration errors and anything
                // newer: the message itself is fine, so keep it.
                tracing::warn!(error = %e, "idempotency store refused the message; nacking");
                Decision::Nack {
                    delay: self.backoff_for(deliveries),
                }
            }
        }
    }
}

/// A message's decision: known now, or after its failure is counted.
pub(crate) enum Judged<T> {
    Now(Handled<T>),
    Count(Retry),
}

/// A retryable handler failure, to be counted before it is decided.
pub(crate) struct Retry {
    key: String,
    deliveries: u32,
    last_error: String,
}

/// The key of a message, or the decision for one that has none it can
/// use (dead-lettered unrun).
pub(crate) fn usable_key<T>(
    key: Result<String, crate::ConsumerError>,
) -> Result<String, Handled<T>> {
    key.map_err(|e| {
        let reason = DeadLetterReason::BadMessage(e.to_string());
        Handled::decided(Decision::DeadLetter { reason }, None)
    })
}

/// The body of a message's idem call: the handler, unless the message is
/// past the delivery valve.
pub(crate) async fn run_handler<T, E, Fut>(
    handler: impl FnOnce(Message) -> Fut,
    msg: &Message,
    over_delivery_limit: bool,
) -> Result<T, Failure<E>>
where
    Fut: Future<Output = Result<T, E>>,
{
    if over_delivery_limit {
        return Err(Failure::OverValve);
    }
    handler(msg.clone()).await.map_err(Failure::Handler)
}

/// Records what happened to a message in its span, and logs it there.
pub(crate) fn report<T>(span: &tracing::Span, handled: &Handled<T>) {
    if let Some(o) = handled.outcome {
        span.record("outcome", o.as_str());
        #[cfg(feature = "otel")]
        idem_core::otel::attribute(span, "idem.outcome", o.as_str());
    }
    span.record("decision", handled.decision.as_str());
    // A disabled span entered changes nothing a subscriber sees.
    let _enter = (!span.is_disabled()).then(|| span.enter());
    match &handled.decision {
        Decision::Ack => tracing::debug!("message acked"),
        Decision::Nack { delay } => {
            tracing::info!(delay_ms = delay.as_millis() as u64, "message nacked")
        }
        Decision::DeadLetter { reason } => {
            tracing::warn!(reason = %reason, kind = reason.kind(), "message dead-lettered")
        }
    }
}
