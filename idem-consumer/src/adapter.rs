//! The one trait a broker implements, and the fetch → handle → settle loop
//! written once for every broker.
//!
//! An adapter says how to fetch a batch of raw deliveries, how to read one
//! as a [`Message`], and how to tell the broker a [`Decision`]. Everything
//! else (running handlers through idem with bounded concurrency, keeping
//! in-flight messages from being redelivered, counting, the polling loop
//! with its shutdown signal and backoff) is provided.

use crate::consumer::Consumer;
use crate::decision::{Classify, DeadLetterReason, Decision};
use crate::error::ConsumerError;
use crate::heartbeat::with_heartbeat;
use crate::message::Message;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::time::Duration;

/// What one poll did, for every broker.
///
/// ```
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Decision, Message, PollReport};
/// use idem_core::{Idempotency, MemoryStore};
/// /// Hands out the same two deliveries on every fetch.
/// struct Twice;
/// impl Adapter for Twice {
///     type Delivery = &'static str;
///     async fn fetch(&self) -> Result<Vec<&'static str>, ConsumerError> { Ok(vec!["o-1", "o-2"]) }
///     fn message_of(&self, id: &&'static str) -> Result<Message, ConsumerError> { Ok(Message::new("{}").with_id(*id)) }
///     async fn apply(&self, _: &&'static str, _: &Decision) -> Result<(), ConsumerError> { Ok(()) }
/// }
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders");
/// let mut total = PollReport::default();
/// for _ in 0..2 {
///     total.add(Twice.poll(&consumer, &|_m: Message| async { Ok::<u8, String>(1) }).await?);
/// }
/// assert_eq!((total.fetched, total.acked, total.dead_lettered), (4, 4, 0)); // duplicates are acked
/// # Ok::<(), ConsumerError>(()) }).unwrap();
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PollReport {
    /// Deliveries handled.
    pub fetched: usize,
    /// Of those, redeliveries (delivery count over 1): after a crash, a
    /// nack, an expired ack wait, or a stale entry taken over.
    pub redelivered: usize,
    /// Acked (done, duplicates and replays included).
    pub acked: usize,
    /// Nacked: to be delivered again after a delay.
    pub nacked: usize,
    /// Dead-lettered (or terminated).
    pub dead_lettered: usize,
}

impl PollReport {
    /// Adds another report's counts to this one.
    ///
    /// ```
    /// let mut total = idem_consumer::PollReport::default();
    /// total.add(idem_consumer::PollReport::default());
    /// assert_eq!(total.fetched, 0);
    /// ```
    pub fn add(&mut self, other: PollReport) {
        self.fetched += other.fetched;
        self.redelivered += other.redelivered;
        self.acked += other.acked;
        self.nacked += other.nacked;
        self.dead_lettered += other.dead_lettered;
    }

    fn count(&mut self, decision: &Decision) {
        match decision {
            Decision::Ack => self.acked += 1,
            Decision::Nack { .. } => self.nacked += 1,
            Decision::DeadLetter { .. } => self.dead_lettered += 1,
        }
    }
}

/// What [`Adapter::run`] does after a failed poll.
///
/// ```
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Decision, Message, Recovery};
/// use idem_core::{Idempotency, MemoryStore};
/// /// A channel the broker closed: polling again cannot help.
/// struct Closed;
/// impl Adapter for Closed {
///     type Delivery = ();
///     async fn fetch(&self) -> Result<Vec<()>, ConsumerError> { Err(ConsumerError::broker("amqp", "fetch", "channel closed")) }
///     fn message_of(&self, _: &()) -> Result<Message, ConsumerError> { unreachable!() }
///     async fn apply(&self, _: &(), _: &Decision) -> Result<(), ConsumerError> { Ok(()) }
///     async fn recover(&self, _: &ConsumerError) -> Recovery { Recovery::Stop }
/// }
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders");
/// let ran = Closed.run(&consumer, &|_m: Message| async { Ok::<u8, String>(1) }, std::future::pending::<()>()).await;
/// assert!(ran.unwrap_err().to_string().contains("channel closed")); // `run` returned instead of retrying
/// # });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recovery {
    /// Wait ([`Consumer::backoff_for`] the number of failures in a row)
    /// and poll again: the client reconnects by itself.
    Backoff,
    /// Poll again at once: the adapter repaired what was wrong.
    Retry,
    /// Stop and return the error: this adapter cannot go on (its channel
    /// is gone); the caller makes a new one.
    Stop,
}

/// A message broker, as the consumer core needs it.
///
/// Implement the four required items for your broker's client, and
/// [`poll`](Adapter::poll) / [`run`](Adapter::run) work: every fetched
/// delivery becomes a [`Message`], handlers run through idem at most once
/// per key (a batch with bounded concurrency, copies inside a batch run
/// once), and each delivery's [`Decision`] goes back to the broker.
///
/// | item | for |
/// | --- | --- |
/// | [`Delivery`](Adapter::Delivery) | what the client hands over (with what it needs to ack) |
/// | [`fetch`](Adapter::fetch) | up to a batch; empty when nothing came within a short wait |
/// | [`message_of`](Adapter::message_of) | payload, producer id, delivery count; `Err` dead-letters it unrun |
/// | [`apply`](Adapter::apply) | ack, nack after the delay (or leave it to come back), dead-letter |
/// | [`apply_batch`](Adapter::apply_batch) | optional: one round trip for a whole batch (default: every `apply` at once) |
/// | [`delivery_count`](Adapter::delivery_count) | optional: the count alone, when cheaper than a whole `message_of` (default: from `message_of`) |
/// | [`keep_alive`](Adapter::keep_alive) + [`keep_alive_period`](Adapter::keep_alive_period) | optional: "still working" while handlers run (progress acks, visibility timeouts) |
/// | [`after_batch`](Adapter::after_batch) | optional: once per batch after every decision was applied (commit offsets) |
/// | [`recover`](Adapter::recover) | optional: what to do after a failed poll |
///
/// A broker without per-message acks (Kafka, Kinesis) records decisions in
/// `apply` and commits in `after_batch`: up to, not past, the lowest offset
/// of each partition that was not acked or dead-lettered.
///
/// The provided methods ([`handle`](Adapter::handle),
/// [`settle`](Adapter::settle), `poll`, `run`) are the same for every
/// broker; don't override them.
///
/// # An adapter in a page
///
/// An in-memory queue whose unacked messages come back, as SQS's do after
/// their visibility timeout (for SQS: `fetch` is `ReceiveMessage`,
/// `apply` is `DeleteMessage` or `ChangeMessageVisibility` with the nack
/// delay, `keep_alive` extends visibility, the delivery count is
/// `ApproximateReceiveCount`):
///
/// ```
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Decision, Message, PollReport};
/// use idem_core::{Idempotency, MemoryStore};
/// use std::collections::VecDeque;
/// use std::sync::Mutex;
///
/// /// A delivery: the message id, its body and how often it was received.
/// struct Received { id: String, body: String, receives: u32 }
///
/// #[derive(Default)]
/// struct MemQueue { ready: Mutex<VecDeque<Received>>, acked: Mutex<Vec<String>>, dead: Mutex<Vec<String>> }
///
/// impl Adapter for MemQueue {
///     type Delivery = Received;
///
///     async fn fetch(&self) -> Result<Vec<Received>, ConsumerError> {
///         let mut q = self.ready.lock().unwrap();
///         let n = q.len().min(10);
///         Ok(q.drain(..n).collect())
///     }
///
///     fn message_of(&self, r: &Received) -> Result<Message, ConsumerError> {
///         Ok(Message::new(r.body.clone())
///             .with_id(r.id.clone())
///             .with_delivery_count(r.receives)
///             .with_source("memory", "orders"))
///     }
///
///     async fn apply(&self, r: &Received, decision: &Decision) -> Result<(), ConsumerError> {
///         match decision {
///             Decision::Ack => self.acked.lock().unwrap().push(r.id.clone()),
///             // A real queue would wait out `delay`; this one is polled by hand.
///             Decision::Nack { .. } => {
///                 let again = Received { id: r.id.clone(), body: r.body.clone(), receives: r.receives + 1 };
///                 self.ready.lock().unwrap().push_back(again);
///             }
///             Decision::DeadLetter { reason } => self.dead.lock().unwrap().push(format!("{}: {reason}", r.id)),
///             _ => {}
///         }
///         Ok(())
///     }
/// }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let queue = MemQueue::default();
/// for (id, body) in [("o-1", "charge 5"), ("o-2", "charge 7"), ("o-1", "charge 5"), ("o-3", "fail")] {
///     queue.ready.lock().unwrap().push_back(Received { id: id.into(), body: body.into(), receives: 1 });
/// }
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let consumer = Consumer::new(idem, "orders.charge").max_failures(2);
/// let charge = |m: Message| async move {
///     match &m.payload()[..] {
///         b"fail" => Err("card declined".to_owned()),
///         _ => Ok(m.payload().len()), // the side effect, once per message id
///     }
/// };
/// let first: PollReport = queue.poll(&consumer, &charge).await?;
/// assert_eq!((first.fetched, first.acked, first.nacked), (4, 3, 1));
/// let second = queue.poll(&consumer, &charge).await?; // o-3 fails again: its second failure
/// assert_eq!((second.redelivered, second.dead_lettered), (1, 1));
/// assert_eq!(*queue.acked.lock().unwrap(), ["o-1", "o-2", "o-1"]);
/// assert!(queue.dead.lock().unwrap()[0].starts_with("o-3: the handler failed 2 times"));
/// # Ok::<(), ConsumerError>(()) }).unwrap();
/// ```
pub trait Adapter: Send + Sync {
    /// One raw delivery as the broker's client hands it over.
    type Delivery: Send + Sync;

    /// Waits a short while (the adapter's block time) for deliveries and
    /// returns those ready, at most a batch; empty when none came.
    fn fetch(&self) -> impl Future<Output = Result<Vec<Self::Delivery>, ConsumerError>> + Send;

    /// The core's view of a delivery: payload, producer id (or
    /// [`Message::with_unreadable_id`]), delivery count, broker and source.
    /// An `Err` (the delivery is not a message at all) is dead-lettered
    /// with [`DeadLetterReason::BadMessage`] without running anything.
    fn message_of(&self, delivery: &Self::Delivery) -> Result<Message, ConsumerError>;

    /// How many times the broker has delivered this delivery's message,
    /// this time included: what [`message_of`](Adapter::message_of) puts
    /// in [`Message::delivery_count`] (the default reads it from there; 1
    /// for a delivery that is not a message). Override it when the count
    /// is cheaper to read alone: [`settle`](Adapter::settle) reads it for
    /// every delivery.
    fn delivery_count(&self, delivery: &Self::Delivery) -> u32 {
        self.message_of(delivery).map_or(1, |m| m.delivery_count())
    }

    /// Tells the broker one decision: ack; nack so that it comes back after
    /// `delay` (or as soon as the broker can); dead-letter with the reason,
    /// falling back to a nack if the dead letter cannot be written, so
    /// that nothing is lost.
    fn apply(
        &self,
        delivery: &Self::Delivery,
        decision: &Decision,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send;

    /// Applies a batch's decisions. The default sends every
    /// [`apply`](Adapter::apply) at once and returns the first error after
    /// all were tried; override it to use one round trip for the batch.
    fn apply_batch(
        &self,
        decided: &[(Self::Delivery, Decision)],
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send {
        async move {
            let sent =
                futures_util::future::join_all(decided.iter().map(|(d, x)| self.apply(d, x)));
            sent.await.into_iter().collect::<Result<Vec<()>, _>>()?;
            Ok(())
        }
    }

    /// How often to call [`keep_alive`](Adapter::keep_alive) while
    /// handlers run (default `None`: never). The core uses the shorter of
    /// this and [`Consumer::keep_alive_period`] (a third of idem's lease).
    fn keep_alive_period(&self) -> Option<Duration> {
        None
    }

    /// Tells the broker that `in_flight` (the whole batch being handled)
    /// is still being worked on, so it does not hand it to another
    /// consumer: JetStream progress acks, a Redis Streams re-claim, an SQS
    /// visibility extension. Failures should only be logged: the worst
    /// case is a redelivery, which idem answers with `InProgress`.
    fn keep_alive(&self, in_flight: &[Self::Delivery]) -> impl Future<Output = ()> + Send {
        let _ = in_flight;
        async {}
    }

    /// Runs once a batch's decisions were applied (default: nothing).
    /// Offset-based brokers commit here.
    fn after_batch(
        &self,
        decided: &[(Self::Delivery, Decision)],
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send {
        let _ = decided;
        async { Ok(()) }
    }

    /// What [`run`](Adapter::run) does after a failed poll (default
    /// [`Recovery::Backoff`]). May repair things first (recreate a
    /// consumer group deleted under it).
    fn recover(&self, error: &ConsumerError) -> impl Future<Output = Recovery> + Send {
        let _ = error;
        async { Recovery::Backoff }
    }

    /// Handles fetched deliveries through `consumer` (a batch: bounded
    /// concurrency, copies run once), calling
    /// [`keep_alive`](Adapter::keep_alive) while handlers run; returns each
    /// delivery with its decision, for [`settle`](Adapter::settle).
    fn handle<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        fetched: Vec<Self::Delivery>,
    ) -> impl Future<Output = Vec<(Self::Delivery, Decision)>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        async move {
            let none: Option<&NoRoundTrips<Self::Delivery>> = None;
            handle_deliveries(self, consumer, handler, fetched, none).await
        }
    }

    /// Applies decisions ([`apply_batch`](Adapter::apply_batch), then
    /// [`after_batch`](Adapter::after_batch)) and counts them.
    fn settle(
        &self,
        decided: Vec<(Self::Delivery, Decision)>,
    ) -> impl Future<Output = Result<PollReport, ConsumerError>> + Send {
        async move {
            let mut report = PollReport {
                fetched: decided.len(),
                ..PollReport::default()
            };
            for (delivery, decision) in &decided {
                report.count(decision);
                let again = self.delivery_count(delivery) > 1;
                report.redelivered += usize::from(again);
            }
            self.apply_batch(&decided).await?;
            self.after_batch(&decided).await?;
            Ok(report)
        }
    }

    /// Fetches one batch, handles it and applies every decision.
    fn poll<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
    ) -> impl Future<Output = Result<PollReport, ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
    {
        async move {
            let fetched = self.fetch().await?;
            if fetched.is_empty() {
                return Ok(PollReport::default());
            }
            let decided = self.handle(consumer, handler, fetched).await;
            self.settle(decided).await
        }
    }

    /// Polls until `shutdown` completes, then drains. A failed poll is
    /// logged and [`recover`](Adapter::recover) says what next: back off
    /// and retry (the default), retry at once, or stop with the error.
    ///
    /// **Shutdown drains.** Once `shutdown` completes, nothing more is
    /// fetched (a fetch waiting for messages is dropped: it took none); the
    /// batch whose handlers are running gets up to
    /// [`Consumer::drain_timeout`] to finish, and its decisions are applied
    /// as usual, so a deploy neither re-runs nor loses in-flight work.
    /// Handlers still running at the deadline are abandoned, not released:
    /// idem keeps their keys until their leases run out (a dropped call
    /// never frees a key whose body started), their deliveries stay
    /// unacked, and the broker's redelivery after the lease is answered as
    /// [`Outcome::Recovered`](idem_core::Outcome::Recovered) (or replayed,
    /// if the body finished meanwhile).
    fn run<C, T, E, H, Fut, S>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: S,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send
    where
        H: Fn(Message) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Serialize + DeserializeOwned + Send + Sync,
        E: fmt::Display + Send,
        C: Classify<E>,
        S: Future + Send,
    {
        async move {
            let mut shutdown = pin!(shutdown);
            let mut failures = 0u32;
            loop {
                let fetched = tokio::select! {
                    biased;
                    _ = &mut shutdown => return Ok(()),
                    r = self.fetch() => r,
                };
                let polled = match fetched {
                    Ok(fetched) if fetched.is_empty() => Ok(PollReport::default()),
                    Ok(fetched) => {
                        let mut handling = pin!(self.handle(consumer, handler, fetched));
                        // The shutdown's output is not `Send`: it must not
                        // live across the awaits below.
                        let decided = tokio::select! {
                            biased;
                            decided = &mut handling => Some(decided),
                            _ = &mut shutdown => None,
                        };
                        match decided {
                            Some(decided) => self.settle(decided).await,
                            None => return drain(self, consumer, handling).await,
                        }
                    }
                    Err(e) => Err(e),
                };
                let Err(e) = polled else {
                    failures = 0;
                    continue;
                };
                failures = failures.saturating_add(1);
                match self.recover(&e).await {
                    Recovery::Stop => return Err(e),
                    Recovery::Retry => {
                        tracing::info!(error = %e, "poll failed; the adapter recovered, polling again");
                    }
                    Recovery::Backoff => {
                        let pause = consumer.backoff_for(failures);
                        tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "poll failed");
                        tokio::select! {
                            biased;
                            _ = &mut shutdown => return Ok(()),
                            _ = tokio::time::sleep(pause) => {}
                        }
                    }
                }
            }
        }
    }
}

/// The end of [`Adapter::run`] after a shutdown: lets the batch in flight
/// finish up to the drain deadline and settles it; past the deadline,
/// abandons it (keys kept by their leases, deliveries unacked).
async fn drain<A, C, F>(
    adapter: &A,
    consumer: &Consumer<C>,
    handling: Pin<&mut F>,
) -> Result<(), ConsumerError>
where
    A: Adapter + ?Sized,
    F: Future<Output = Vec<(A::Delivery, Decision)>>,
{
    let deadline = consumer.drain_deadline();
    tracing::info!(
        deadline_ms = deadline.as_millis() as u64,
        "shutting down: letting the handlers in flight finish"
    );
    match tokio::time::timeout(deadline, handling).await {
        Ok(decided) => {
            let report = adapter.settle(decided).await?;
            tracing::info!(?report, "shut down after settling the batch in flight");
        }
        Err(_) => tracing::warn!(
            deadline_ms = deadline.as_millis() as u64,
            "shut down with handlers still running past the drain deadline: their messages stay \
             unacked and their keys held until their leases run out; the redelivery then takes \
             over (Outcome::Recovered) or replays"
        ),
    }
    Ok(())
}

/// The store's own round trips: what [`Adapter::handle`] passes.
type NoRoundTrips<D> = fn(&[usize], &[D]) -> Option<idem_core::FinishRoundTrip>;

/// [`Adapter::handle`], with `round_trips` making the round trip that
/// stores a set of results ([`Batch::finish_with`](idem_core::Batch::finish_with)),
/// from the indices in `fetched` of the deliveries whose results it
/// stores (every one decided [`Decision::Ack`]) and `fetched` itself.
pub(crate) async fn handle_deliveries<A, C, T, E, H, Fut, R>(
    adapter: &A,
    consumer: &Consumer<C>,
    handler: &H,
    fetched: Vec<A::Delivery>,
    round_trips: Option<&R>,
) -> Vec<(A::Delivery, Decision)>
where
    A: Adapter + ?Sized,
    R: Fn(&[usize], &[A::Delivery]) -> Option<idem_core::FinishRoundTrip> + Send + Sync,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Serialize + DeserializeOwned + Send + Sync,
    E: fmt::Display + Send,
    C: Classify<E>,
{
    let mut decided: Vec<Option<Decision>> = Vec::with_capacity(fetched.len());
    let mut msgs = Vec::with_capacity(fetched.len());
    let mut msg_at = Vec::with_capacity(fetched.len());
    for delivery in &fetched {
        match adapter.message_of(delivery) {
            Ok(m) => {
                msg_at.push(decided.len());
                msgs.push(m);
                decided.push(None);
            }
            Err(e) => {
                tracing::warn!(error = %e, "delivery is not a readable message; dead-lettering it");
                let reason = DeadLetterReason::BadMessage(e.to_string());
                decided.push(Some(Decision::DeadLetter { reason }));
            }
        }
    }
    // Round trips see the indices of fetched deliveries, not of messages.
    let make = round_trips.map(|make| {
        let (msg_at, fetched) = (&msg_at, &fetched);
        move |done: &[usize]| {
            let done: Vec<usize> = done
                .iter()
                .filter_map(|&m| msg_at.get(m).copied())
                .collect();
            make(&done, fetched)
        }
    });
    let batch = consumer.handle_batch_with(
        &msgs,
        handler,
        make.as_ref().map(|m| m as &crate::batch::MakeRoundTrip<'_>),
    );
    let handled = match adapter.keep_alive_period() {
        Some(p) if !msgs.is_empty() => {
            let period = p.min(consumer.keep_alive_period());
            with_heartbeat(batch, period, || adapter.keep_alive(&fetched)).await
        }
        _ => batch.await,
    };
    let mut handled = handled.into_iter();
    fetched
        .into_iter()
        .zip(decided)
        .map(|(delivery, d)| {
            let d = d.or_else(|| handled.next().map(|h| h.decision));
            // One Handled per readable message: never short.
            (
                delivery,
                d.unwrap_or(Decision::Nack {
                    delay: Duration::ZERO,
                }),
            )
        })
        .collect()
}
