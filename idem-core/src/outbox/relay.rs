//! The one relay: [`OutboxRelay`] drains any outbox that implements
//! [`RelaySource`] into a [`Sink`], at least once, in order per key.
//!
//! What every relay does is here once: the builder, the pass (lock, read,
//! send in waves, delete what the broker confirmed, park or back off what
//! it did not), the reports, and the run loop with its outage backoff and
//! its retry wake-ups. What differs per store is the source's: how a shard
//! is held (a Redis stream's lock with a lease, a PostgreSQL transaction's
//! row locks), how messages are read and written back, and what wakes a
//! sleeping relay (PostgreSQL's `LISTEN`).

use super::message::OutboxMessage;
use super::relaying::{Failed, RelayReport, SendPolicy, Waves, send_in_waves};
use super::sink::Sink;
use crate::Error;
use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::time::Duration;
use tokio::time::Instant;

/// Messages a pass takes by default.
const DEFAULT_BATCH: usize = 256;

/// An outbox a relay drains: where messages wait, how a relay holds them
/// while it sends, and how it writes back what the broker said. The Redis
/// outbox (`idem_redis::outbox::RedisSource`) and the PostgreSQL one
/// (`idem_postgres::outbox::PgSource`) implement it; [`OutboxRelay`] does
/// the rest.
///
/// An outbox is split into shards, each held by one relay at a time (a
/// Redis stream under its lock; the PostgreSQL table, whose relays share
/// it key by key through row locks). A pass over a shard is
/// [`lock`](RelaySource::lock), [`read`](RelaySource::read), the sends,
/// [`delete`](RelaySource::delete) of what was confirmed,
/// [`park`](RelaySource::park) of what failed, and
/// [`commit`](RelaySource::commit). A source keeps what it needs between
/// passes (retry times, scan cursors) in itself: a relay owns its source.
///
/// The order per key is the source's to keep in `read`: it returns a key's
/// messages oldest first, and none of a key whose earlier message is parked
/// or backing off (the relay sends a key's next message only once the
/// previous one was confirmed, and holds the rest of a key back behind a
/// failure within a pass).
///
/// The `run` hooks ([`start`](RelaySource::start) and the provided
/// `listen`, `rest`, `woken`, `stop`) shape how a relay sleeps; their
/// defaults suit a source that nothing wakes but its poll. The methods
/// return `impl Future + Send` so that a relay runs on a multi-threaded
/// runtime; an implementation writes them as `async fn`.
///
/// A complete source, in memory, is the example of [`OutboxRelay`].
pub trait RelaySource: Send + Sync {
    /// What one hold covers (a Redis stream, the PostgreSQL table); shown
    /// in the relay's logs.
    type Shard: fmt::Display + Send + Sync;
    /// A held shard, for one pass (the lock's state, what was read ahead,
    /// a transaction).
    type Hold: Send;
    /// Where a message is kept (a stream entry's id, a row's `seq`).
    type At: Send + Sync;
    /// What one `run` keeps between passes for its wake-ups (a `LISTEN`
    /// connection); `()` for a source that has none.
    type Wake: Send;

    /// The poll interval a relay starts with.
    const POLL: Duration;
    /// The shortest poll interval [`OutboxRelay::poll_interval`] accepts.
    const MIN_POLL: Duration;

    /// The shards to drain this pass.
    fn shards(&self) -> impl Future<Output = Result<Vec<Self::Shard>, Error>> + Send;

    /// Takes (or renews) this relay's hold on `shard` for a pass; `None`
    /// when another relay holds it. `batch` is what the pass will
    /// [`read`](RelaySource::read), for a source that reads ahead in the
    /// same round trip.
    fn lock(
        &self,
        shard: &Self::Shard,
        batch: usize,
    ) -> impl Future<Output = Result<Option<Self::Hold>, Error>> + Send;

    /// Keeps the hold on `shard` while a pass runs, and returns once it is
    /// lost: the relay then abandons the pass (another relay has the shard,
    /// and sends again what this one sent and did not delete, under the
    /// same ids). By default a hold cannot be lost mid-pass.
    fn keep(&self, shard: &Self::Shard) -> impl Future<Output = ()> + Send {
        let _ = shard;
        std::future::pending()
    }

    /// Up to `batch` messages to send, oldest first, each with where it is
    /// kept; none of a key held back by a parked or backing-off message.
    /// Each carries the failed sends it had so far (`attempts`), which
    /// sets its next backoff.
    fn read(
        &self,
        shard: &Self::Shard,
        hold: &mut Self::Hold,
        batch: usize,
    ) -> impl Future<Output = Result<Vec<(Self::At, OutboxMessage)>, Error>> + Send;

    /// Deletes what the broker confirmed (never empty). Failing here, the
    /// messages stay and are sent again, with the same ids.
    fn delete(
        &self,
        shard: &Self::Shard,
        hold: &mut Self::Hold,
        sent: &[Self::At],
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Writes back what failed (never empty): parks a message the broker
    /// refused (`park`: it stays, its key waits behind it, its reason
    /// kept), and holds a failed one back until its `retry_in` with one
    /// more attempt counted.
    fn park(
        &self,
        shard: &Self::Shard,
        hold: &mut Self::Hold,
        failed: Vec<Failed<Self::At>>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Ends a pass: makes what `delete` and `park` wrote durable (a
    /// transaction commits) or, when the pass handled nothing
    /// (`report.handled() == 0`), lets it go.
    fn commit(
        &self,
        shard: &Self::Shard,
        hold: Self::Hold,
        report: &RelayReport,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// A `run` begins: logs the relay's start (naming the outbox and the
    /// sink, `sink`) and makes its wake-up state.
    fn start(&self, sink: &str) -> Self::Wake;

    /// Before each pass of a `run` (reconnect a `LISTEN`, drop the
    /// notifications the coming pass covers). Does nothing by default.
    fn listen(&self, wake: &mut Self::Wake) -> impl Future<Output = ()> + Send {
        let _ = wake;
        async {}
    }

    /// After a successful pass of a `run`: whether to pass again at once
    /// rather than sleep (until the poll interval ends, a retry falls due,
    /// or [`woken`](RelaySource::woken)). By default: when the pass sent or
    /// parked anything, since more may wait.
    fn rest(&self, wake: &mut Self::Wake, pass: &RelayReport) -> impl Future<Output = bool> + Send {
        let _ = wake;
        let again = pass.sent + pass.parked > 0;
        async move { again }
    }

    /// Completes when something wakes a sleeping relay early (a
    /// notification of new messages). Never, by default.
    fn woken(&self, wake: &mut Self::Wake) -> impl Future<Output = ()> + Send {
        let _ = wake;
        std::future::pending()
    }

    /// A `run` ends: free what it held (locks, so that a peer takes over at
    /// once). Does nothing by default.
    fn stop(&self, wake: Self::Wake) -> impl Future<Output = ()> + Send {
        let _ = wake;
        async {}
    }
}

/// Publishes an outbox (a [`RelaySource`]) through a [`Sink`]: at least
/// once, in order per key, deleting a message only once the broker
/// confirmed it, parking what the broker refuses, backing off what failed.
/// Stores name theirs: `idem_redis::outbox::RedisRelay` and
/// `idem_postgres::outbox::PgRelay` are this type over their sources.
///
/// A source of your own, in memory (a `Vec`, one shard, no locks), and a
/// sink that prints:
///
/// ```
/// use idem_core::Error;
/// use idem_core::outbox::{
///     Failed, OutboxMessage, OutboxRelay, RelayReport, RelaySource, Sink, SinkError, async_trait,
/// };
/// use std::sync::Mutex;
/// use std::time::Duration;
///
/// /// Messages in a `Vec`; a parked one stays with its flag set.
/// struct Memory(Mutex<Vec<(u64, OutboxMessage, bool)>>);
///
/// impl RelaySource for Memory {
///     type Shard = &'static str;
///     type Hold = ();
///     type At = u64;
///     type Wake = ();
///     const POLL: Duration = Duration::from_millis(100);
///     const MIN_POLL: Duration = Duration::from_millis(1);
///
///     async fn shards(&self) -> Result<Vec<&'static str>, Error> {
///         Ok(vec!["memory"])
///     }
///     async fn lock(&self, _: &&'static str, _batch: usize) -> Result<Option<()>, Error> {
///         Ok(Some(())) // one relay: nothing to share
///     }
///     async fn read(&self, _: &&'static str, _: &mut (), batch: usize) -> Result<Vec<(u64, OutboxMessage)>, Error> {
///         let all = self.0.lock().unwrap();
///         // A parked message holds its key's later ones back.
///         let parked: Vec<&str> = all.iter().filter(|m| m.2).map(|m| m.1.key.as_str()).collect();
///         Ok(all.iter().filter(|m| !parked.contains(&m.1.key.as_str()))
///             .take(batch).map(|(at, m, _)| (*at, m.clone())).collect())
///     }
///     async fn delete(&self, _: &&'static str, _: &mut (), sent: &[u64]) -> Result<(), Error> {
///         self.0.lock().unwrap().retain(|m| !sent.contains(&m.0));
///         Ok(())
///     }
///     async fn park(&self, _: &&'static str, _: &mut (), failed: Vec<Failed<u64>>) -> Result<(), Error> {
///         let mut all = self.0.lock().unwrap();
///         for f in failed {
///             let m = all.iter_mut().find(|m| m.0 == f.at).unwrap();
///             m.1.attempts += 1;
///             m.2 = f.park; // (a real source also waits out `f.retry_in`)
///         }
///         Ok(())
///     }
///     async fn commit(&self, _: &&'static str, _: (), _: &RelayReport) -> Result<(), Error> {
///         Ok(()) // written as it went
///     }
///     fn start(&self, sink: &str) {
///         tracing::info!(sink, "outbox relay started");
///     }
/// }
///
/// struct Print;
/// #[async_trait]
/// impl Sink for Print {
///     async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
///         batch.iter().map(|m| if m.topic == "nowhere" {
///             Err(SinkError::refused("no such topic"))
///         } else {
///             println!("{} → {}", m.id, m.topic);
///             Ok(())
///         }).collect()
///     }
///     fn describe(&self) -> String { "stdout".into() }
/// }
///
/// let msg = |id: &str, topic: &str, key: &str| OutboxMessage::new(id, topic, key, "{}");
/// let outbox = Memory(Mutex::new(vec![
///     (1, msg("a1", "nowhere", "a"), false),
///     (2, msg("b1", "orders", "b"), false),
///     (3, msg("a2", "orders", "a"), false),
/// ]));
/// let relay = OutboxRelay::<Memory, _>::new(outbox, Print).batch_size(100);
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let report = relay.drain_once().await?;
/// assert_eq!((report.sent, report.parked), (1, 1)); // b1 sent; a1 parked, a2 behind it
/// assert_eq!(relay.drain_once().await?.handled(), 0);
/// # Ok::<_, Error>(()) }).unwrap();
/// ```
pub struct OutboxRelay<S, K> {
    source: S,
    sink: K,
    batch: usize,
    poll: Duration,
    policy: SendPolicy,
}

impl<S: fmt::Debug, K> fmt::Debug for OutboxRelay<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("source", &self.source)
            .field("batch", &self.batch)
            .field("poll", &self.poll)
            .field("send_timeout", &self.policy.send_timeout)
            .finish_non_exhaustive()
    }
}

impl<S: RelaySource, K: Sink> OutboxRelay<S, K> {
    /// A relay of `source` (anything the source is made from: a store, its
    /// outbox) into `sink`, with 256 messages a pass, the source's poll
    /// interval ([`RelaySource::POLL`]), a 30 s send timeout and retries
    /// backing off from 200 ms to 30 s.
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # fn demo<S: RelaySource, K: Sink>(source: S, sink: K) {
    /// let relay = OutboxRelay::<S, K>::new(source, sink);
    /// # }
    /// ```
    pub fn new(source: impl Into<S>, sink: K) -> Self {
        OutboxRelay {
            source: source.into(),
            sink,
            batch: DEFAULT_BATCH,
            poll: S::POLL,
            policy: SendPolicy::default(),
        }
    }

    /// Messages a pass takes (1 to 10,000; default 256).
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # fn demo<S: RelaySource, K: Sink>(r: OutboxRelay<S, K>) {
    /// let r = r.batch_size(1000);
    /// # }
    /// ```
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, 10_000);
        self
    }

    /// How long an idle relay waits before looking again (at least the
    /// source's [`MIN_POLL`](RelaySource::MIN_POLL)). A Redis relay polls
    /// (default 100 ms: one lock renewal and two reads per stream, ten
    /// times a second); a PostgreSQL relay is woken by `LISTEN`/`NOTIFY`,
    /// and its poll (default 5 s) is the insurance for notifications lost
    /// while that connection is down.
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # fn demo<S: RelaySource, K: Sink>(r: OutboxRelay<S, K>) {
    /// let r = r.poll_interval(std::time::Duration::from_millis(20));
    /// # }
    /// ```
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(S::MIN_POLL);
        self
    }

    /// How long one wave of sends may wait for the broker's confirmations
    /// (default 30 s); unconfirmed messages are retried (the broker may have
    /// them: their ids make the copies harmless).
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # fn demo<S: RelaySource, K: Sink>(r: OutboxRelay<S, K>) {
    /// let r = r.send_timeout(std::time::Duration::from_secs(5));
    /// # }
    /// ```
    pub fn send_timeout(mut self, limit: Duration) -> Self {
        self.policy.send_timeout = limit.max(Duration::from_millis(1));
        self
    }

    /// The retry delay after a failed send: `first`, doubling per attempt up
    /// to `max` (default 200 ms to 30 s). The key's later messages wait.
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # use std::time::Duration;
    /// # fn demo<S: RelaySource, K: Sink>(r: OutboxRelay<S, K>) {
    /// let r = r.retry_backoff(Duration::from_millis(50), Duration::from_secs(5));
    /// # }
    /// ```
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.policy.first_backoff = first;
        self.policy.max_backoff = max.max(first);
        self
    }

    /// One pass over every shard this relay can hold: sends up to a batch
    /// of waiting messages from each and deletes what the broker
    /// confirmed. Fails (with [`Error::Unavailable`] when the store cannot
    /// be reached) only when no shard's pass handled anything: nothing is
    /// lost, the messages stay. Sink failures are not errors, they are
    /// counted in the report.
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # async fn demo<S: RelaySource, K: Sink>(relay: OutboxRelay<S, K>) -> Result<(), idem_core::Error> {
    /// // Drain everything (a test, a one-shot job):
    /// while relay.drain_once().await?.sent > 0 {}
    /// # Ok(()) }
    /// ```
    pub async fn drain_once(&self) -> Result<RelayReport, Error> {
        let mut report = RelayReport::default();
        let mut failed = None;
        for shard in self.source.shards().await? {
            match self.drain_shard(&shard).await {
                Ok(pass) => report.add(pass),
                Err(e) => {
                    // One shard's failure does not stop the others'.
                    tracing::debug!(%shard, error = %e, "outbox shard pass failed");
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) if report.handled() == 0 => Err(e),
            _ => Ok(report),
        }
    }

    /// One shard's pass, under its hold, kept while the pass runs; a pass
    /// whose hold is lost stops where it is (another relay has the shard:
    /// what this one sent and did not delete goes again, same ids).
    async fn drain_shard(&self, shard: &S::Shard) -> Result<RelayReport, Error> {
        tokio::select! {
            pass = self.pass(shard) => pass,
            () = self.source.keep(shard) => Ok(RelayReport::default()),
        }
    }

    async fn pass(&self, shard: &S::Shard) -> Result<RelayReport, Error> {
        let Some(mut hold) = self.source.lock(shard, self.batch).await? else {
            return Ok(RelayReport::default());
        };
        let messages = self.source.read(shard, &mut hold, self.batch).await?;
        if messages.is_empty() {
            let idle = RelayReport::default();
            self.source.commit(shard, hold, &idle).await?;
            return Ok(idle);
        }
        let Waves {
            sent,
            failed,
            report,
        } = send_in_waves(&self.sink, &self.policy, messages).await;
        // Deleted only now, after the broker confirmed: a relay killed
        // before this sends them again, with the same ids.
        if !sent.is_empty() {
            self.source.delete(shard, &mut hold, &sent).await?;
        }
        if !failed.is_empty() {
            self.source.park(shard, &mut hold, failed).await?;
        }
        self.source.commit(shard, hold, &report).await?;
        Ok(report)
    }

    /// Runs passes until `shutdown` completes: at once while there is work,
    /// else after the poll interval, when a retry falls due, or when the
    /// source wakes the relay (PostgreSQL: an insert's notification). A
    /// pass under way when `shutdown` completes finishes first (it is
    /// bounded by the send timeout), so nothing is sent twice because of
    /// the stop; then the relay frees what it holds, so a peer takes over
    /// at once. The store or the broker being down is logged and retried,
    /// never returned: the relay outlives outages.
    ///
    /// ```no_run
    /// # use idem_core::outbox::{OutboxRelay, RelaySource, Sink};
    /// # async fn demo<S: RelaySource, K: Sink>(relay: OutboxRelay<S, K>) {
    /// let (_stop, stopped) = tokio::sync::oneshot::channel::<()>(); // send on `_stop` at shutdown
    /// let report = relay.run(async { let _ = stopped.await; }).await;
    /// # }
    /// ```
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> RelayReport {
        let mut shutdown = pin!(shutdown);
        let mut totals = RelayReport::default();
        let mut next_retry: Option<Instant> = None;
        let mut outages = 0u32;
        let mut wake = self.source.start(&self.sink.describe());
        loop {
            self.source.listen(&mut wake).await;
            let now = Instant::now();
            if next_retry.is_some_and(|at| at <= now) {
                next_retry = None;
            }
            let wait = match self.drain_once().await {
                Ok(pass) => {
                    outages = 0;
                    totals.add(pass);
                    if let Some(d) = pass.retry_in {
                        let at = now + d;
                        next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
                    }
                    if self.source.rest(&mut wake, &pass).await {
                        Duration::ZERO
                    } else {
                        // Counted from before the pass and slept after it:
                        // a retry the pass scheduled is due by then.
                        next_retry.map_or(self.poll, |at| {
                            at.saturating_duration_since(now).min(self.poll)
                        })
                    }
                }
                Err(e) => {
                    outages = outages.saturating_add(1);
                    let wait = self.policy.backoff(outages);
                    tracing::warn!(error = %e, retry_in = ?wait, "outbox relay pass failed; nothing is lost, retrying");
                    wait
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
                () = self.source.woken(&mut wake) => {}
            }
        }
        self.source.stop(wake).await;
        tracing::info!(
            sent = totals.sent,
            parked = totals.parked,
            failed = totals.failed,
            "outbox relay stopped"
        );
        totals
    }
}
