//! Kafka adapter (`rdkafka`): a consumer group whose offsets are committed
//! only up to the lowest record not yet decided.
//!
//! Kafka has no per-message ack: the group keeps one offset per partition,
//! "everything before this is done". This adapter handles the records of a
//! partition concurrently (at most [`Consumer::concurrency`] at once over
//! all partitions), and commits, every [`KafkaConfig::commit_interval`],
//! the **lowest offset not yet decided** of each partition (see
//! [`OffsetTracker`]). A crash at any moment therefore re-delivers only
//! records at or after an undecided one, and idem replays the ones whose
//! side effect is already recorded.
//!
//! | idem's decision | what happens to the record | its offset |
//! | --- | --- | --- |
//! | ack (executed, replayed, recovered) | done | decided |
//! | nack, the handler failed (retryable) | run again in this process after the backoff, up to [`KafkaConfig::attempts_in_process`] runs; then published to the retry topic (or, without one, the dead-letter topic) | undecided until published, then decided |
//! | nack, the handler did not run (idem's store down, another consumer holds the key) | waits and tries again for as long as the partition is ours: fail-closed | undecided |
//! | dead-letter (permanent error, `max_failures`, `max_deliveries`, bad key, fingerprint mismatch) | published to the dead-letter topic with the reason headers ([`header_names`] and the shared [`dead_letter_field`](crate::dead_letter_field)s) | undecided until published, then decided |
//!
//! The records that can start together (up to the concurrency, no two
//! with one key) make their first try through idem as one batch: one claims
//! round trip, the handlers run concurrently, their results stored as they
//! finish; each record is decided as soon as its own result is stored, so
//! a slow handler holds back no other record's decision. Later tries go on
//! record by record.
//!
//! A record whose idempotency key is already in flight in this process
//! waits for that one to finish (then replays); with
//! [`KafkaConfig::in_order_per_key`], records of one partition with the same
//! record key also run one after the other, in offset order.
//!
//! **Rebalances.** When the group takes a partition away, the adapter stops
//! starting its records, gives those in flight up to
//! [`KafkaConfig::revoke_deadline`] to finish, commits what is decided and
//! lets the partition go. A handler still running after the deadline keeps
//! its idem lease while it runs: the next owner's claim waits
//! (`InProgress`) and then replays its result; if this process dies
//! instead, the next owner takes over after the lease (`Recovered`), and a
//! late completion by the old holder is refused by owner token.
//!
//! **Keys.** By default the `idempotency-key` header ([`KafkaKey`]); or the
//! record key plus a hash of the payload; or derived from the payload by
//! giving the [`Consumer`] a [`KeySource::Payload`](crate::KeySource). The
//! fingerprint is the payload hash: a key reused for another payload is
//! dead-lettered.
//!
//! **Headers.** Kafka header names are bytes; rdkafka reads them as `&str`
//! and panics on a name that is not UTF-8. The adapter catches that panic
//! (each header is read once, when the record is taken), logs a warning
//! and handles the record without those headers: none of them can be the
//! key header or a trace header, and the key and payload are unaffected.
//! A copy to the retry or dead-letter topic keeps every header, byte for
//! byte. The process's panic hook still runs (by default it prints
//! rdkafka's message to stderr), and under `panic = "abort"` there is
//! nothing to catch.
//!
//! ```no_run
//! use idem_consumer::kafka::{KafkaConfig, KafkaConsumer};
//! use idem_consumer::{Consumer, Message};
//! use idem_core::Idempotency;
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let kafka = KafkaConsumer::connect(
//!     KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"]).dead_letter_topic("orders.DLT"),
//! )?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! kafka.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `rdkafka` crate this adapter is built on, re-exported so your
/// producer and admin code uses the same version.
pub use rdkafka;

mod config;
mod gates;
mod hand_off;
mod headers;
mod offsets;
mod poller;
mod report;
mod schedule;
mod tries;

pub use config::{KafkaConfig, KafkaKey};
pub use hand_off::header_names;
pub use offsets::{OffsetTracker, PartitionOffsets};
pub use report::KafkaReport;

use crate::consumer::Consumer;
use crate::decision::Classify;
use crate::error::ConsumerError;
use crate::message::Message;
use futures_util::StreamExt;
use futures_util::future::{Either, OptionFuture};
use futures_util::stream::FuturesUnordered;
use gates::{Gated, Gates, StartQueue};
use hand_off::Destination;
use poller::{Ctx, Shared, Taken};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;
use tries::{After, Again, Started};

const BROKER: &str = "kafka";

/// How many times a run's last commit is tried when the broker refuses it.
const LAST_COMMIT_TRIES: u32 = 3;

/// Lowercase hex digits, as message ids and gate names spell raw bytes.
fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// How one record's handling ended.
enum End {
    Acked,
    Moved(Destination),
    Abandoned,
}

/// One finished record, back in the handler loop.
struct Done<'a> {
    held: Held<'a>,
    gates: Gates,
    end: End,
    report: KafkaReport,
}

/// A started record, owned by its handler future until that future hands
/// it back in a [`Done`] and `finish` accounts for it.
///
/// Created before the future is first polled (it is an argument of
/// `turn`, then of `resume`), so that a future dropped at any point still
/// drops it. If
/// the future is dropped unfinished (still running at the drain deadline,
/// or `run` itself dropped), the drop does what `finish` would have: the
/// record is no longer in flight (a revocation need not wait for it), it
/// stays undecided (its offset holds the commit back), and it is kept for
/// the next `run` of this consumer, which handles it again. Its idem key
/// keeps the dropped handler's claim (the body may have made effects), so
/// that run waits, fail-closed as for any key in flight elsewhere, until
/// the lease ends, then takes over (`Recovered`); a late completion of the
/// dropped body cannot happen (the future is gone). Without a next `run`,
/// the partition's next owner reads it from the commit and does the same.
struct Held<'a> {
    taken: Taken,
    owner: &'a KafkaConsumer,
    /// `finish` accounted for it: the drop does nothing.
    settled: bool,
}

impl<'a> Held<'a> {
    /// `taken`, counted in flight by [`Shared::begin`].
    fn new(owner: &'a KafkaConsumer, taken: Taken) -> Held<'a> {
        Held {
            taken,
            owner,
            settled: false,
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.owner.shared.dropped(&self.taken);
        // A clone, as a value with a destructor cannot give its fields
        // away: this only happens when a run ends with handlers unfinished.
        self.owner.keep([self.taken.clone()]);
    }
}

/// The run loop's queue of records waiting to start. When the run ends
/// (a shutdown starts nothing more; or `run` is dropped), what is still in
/// it is kept for the next `run` of the consumer: taken from the poll
/// thread's channel, these records are not read again from the broker
/// while the partition stays ours, and their offsets hold its commit back.
struct Backlog<'a> {
    queue: StartQueue<Waiting>,
    owner: &'a KafkaConsumer,
}

impl Drop for Backlog<'_> {
    fn drop(&mut self) {
        self.owner.keep(self.queue.drain().map(|w| w.taken));
    }
}

/// A record waiting for its turn (its key is in flight).
struct Waiting {
    taken: Taken,
    key: Result<String, ConsumerError>,
    fingerprint: idem_core::Fingerprint,
    gates: Gates,
}

impl Gated for Waiting {
    fn gates(&self) -> &[u64] {
        self.gates.as_slice()
    }
}

/// A Kafka consumer-group member run through idem.
///
/// [`connect`](Self::connect) joins the group on a polling thread of its
/// own; [`run`](Self::run) handles records until its shutdown future
/// completes; [`close`](Self::close) leaves the group before it returns
/// (dropping it leaves too, later, on the polling thread).
///
/// ```no_run
/// use idem_consumer::kafka::{KafkaConfig, KafkaConsumer};
/// use idem_consumer::{Consumer, ConsumerError, Message};
/// use idem_core::Idempotency;
///
/// # async fn demo(idem: Idempotency) -> Result<(), ConsumerError> {
/// let consumer = Consumer::new(idem, "orders.charge");
/// let kafka = KafkaConsumer::connect(KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"]))?;
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let shutdown = tokio::time::sleep(std::time::Duration::from_secs(60));
/// kafka.run(&consumer, &charge, shutdown).await?; // drains and commits, then returns
/// println!("{} commits, partition 0 at {:?}", kafka.commits(), kafka.last_committed("orders", 0));
/// kafka.close().await; // out of the group before the process exits
/// # Ok(()) }
/// ```
pub struct KafkaConsumer {
    consumer: Arc<BaseConsumer<Ctx>>,
    producer: FutureProducer,
    shared: Arc<Shared>,
    rx: Mutex<mpsc::Receiver<Taken>>,
    /// Records a `run` ended without deciding, for the next `run`: taken
    /// from `rx` but not started (shutdown starts nothing more), paused
    /// between attempts at shutdown, or dropped with their handler at the
    /// drain deadline. Their partition's offsets are still undecided and
    /// the broker does not send them again while the partition is ours, so
    /// without this they would hold that partition's commit back for good
    /// (until a rebalance), unhandled. Only `run`, which holds `rx`'s lock,
    /// touches it.
    kept: StdMutex<Vec<Taken>>,
    cfg: Arc<KafkaConfig>,
    stop: Arc<AtomicBool>,
    /// Taken by [`close`](KafkaConsumer::close), which waits for the thread.
    poll_thread: Option<std::thread::JoinHandle<()>>,
    /// The seed of the gate hashes (random per consumer: no one can pick
    /// keys that collide on purpose).
    gate_seed: foldhash::fast::RandomState,
}

impl fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        // The poll thread sees the flag (or its channel closed), drops its
        // handle on the consumer and so leaves the group.
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl KafkaConsumer {
    /// Creates the consumer and its producer (for retry and dead-letter
    /// topics), subscribes and starts polling: the member joins the group
    /// now, and records assigned to it wait (at most
    /// [`KafkaConfig::buffer`]) until [`run`](Self::run) handles them, so
    /// connect when you are about to run.
    ///
    /// Fails with [`ConsumerError::Config`] on an invalid librdkafka
    /// property or no topic; the broker is reached lazily (librdkafka
    /// retries and reconnects on its own).
    pub fn connect(cfg: KafkaConfig) -> Result<KafkaConsumer, ConsumerError> {
        if cfg.topics.is_empty() {
            return Err(ConsumerError::Config(
                "KafkaConfig has no topic to consume".into(),
            ));
        }
        let cfg = Arc::new(cfg);
        let shared = Arc::new(Shared::new(cfg.revoke_deadline));
        let consumer: BaseConsumer<Ctx> = cfg
            .client_config()
            .create_with_context(Ctx {
                shared: shared.clone(),
            })
            .map_err(|e| ConsumerError::Config(format!("kafka consumer: {e}")))?;
        let mut topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
        if let Some(rt) = &cfg.retry_topic
            && !topics.contains(&rt.as_str())
        {
            topics.push(rt);
        }
        consumer
            .subscribe(&topics)
            .map_err(|e| ConsumerError::broker_error(BROKER, "subscribe", e))?;
        let mut producer_cfg = ClientConfig::new();
        producer_cfg
            .set("bootstrap.servers", &cfg.brokers)
            .set("enable.idempotence", "false");
        let producer: FutureProducer = producer_cfg
            .create()
            .map_err(|e| ConsumerError::Config(format!("kafka producer: {e}")))?;
        let consumer = Arc::new(consumer);
        let (tx, rx) = mpsc::channel(cfg.buffer);
        let stop = Arc::new(AtomicBool::new(false));
        let poll_thread = {
            let (consumer, shared, cfg, stop) =
                (consumer.clone(), shared.clone(), cfg.clone(), stop.clone());
            std::thread::Builder::new()
                .name("idem-kafka-poll".into())
                .spawn(move || poller::poll_loop(consumer, shared, cfg, tx, stop))
                .map_err(|e| ConsumerError::Config(format!("cannot start the poll thread: {e}")))?
        };
        Ok(KafkaConsumer {
            consumer,
            producer,
            shared,
            rx: Mutex::new(rx),
            kept: StdMutex::new(Vec::new()),
            cfg,
            stop,
            poll_thread: Some(poll_thread),
            gate_seed: foldhash::fast::RandomState::default(),
        })
    }

    /// Leaves the group, and returns once it has left: the poll thread
    /// stops, then librdkafka gives up the partitions and waits for the
    /// broker to answer its `LeaveGroup`. Records taken and not decided
    /// are dropped, undecided: the partition's next owner reads them from
    /// the last commit (call it after [`run`](Self::run) has returned,
    /// which drains and commits).
    ///
    /// Dropping the consumer leaves the group too, but later: the poll
    /// thread notices within its poll interval (100 ms) and leaves then. A
    /// process that exits first never sends the `LeaveGroup`, and a Kafka
    /// broker keeps its partitions from the other members until
    /// `session.timeout.ms` has passed (45 s by default). End a shutdown
    /// with `close`:
    ///
    /// ```no_run
    /// # use idem_consumer::kafka::{KafkaConfig, KafkaConsumer};
    /// # use idem_consumer::{Consumer, Message};
    /// # async fn demo(consumer: Consumer) -> Result<(), idem_consumer::ConsumerError> {
    /// let kafka = KafkaConsumer::connect(KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"]))?;
    /// let charge = |m: Message| async move { Ok::<_, std::io::Error>(()) };
    /// let shutdown = tokio::time::sleep(std::time::Duration::from_secs(60));
    /// kafka.run(&consumer, &charge, shutdown).await?;
    /// kafka.close().await; // the other members get the partitions now
    /// # Ok(()) }
    /// ```
    pub async fn close(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // A poll thread blocked on a full channel sees it closed.
        self.rx.get_mut().close();
        let thread = self.poll_thread.take();
        let (done, closed) = tokio::sync::oneshot::channel::<()>();
        // A thread of its own, not `spawn_blocking`: a `close` given up
        // (a timeout around it) leaves it running without holding up the
        // runtime's shutdown.
        let closing = std::thread::Builder::new()
            .name("idem-kafka-close".into())
            .spawn(move || {
                if let Some(thread) = thread
                    && thread.join().is_err()
                {
                    tracing::warn!("the kafka poll thread panicked; closing the consumer anyway");
                }
                // A commit that a dropped `run` left going holds the
                // consumer too (a sync commit, bounded by librdkafka's
                // request timeout): the member leaves with the last handle.
                self.shared.wait_for_commits();
                // The last handle on librdkafka's consumer: dropping it
                // closes the consumer, which revokes the partitions and
                // leaves the group, answered.
                drop(self);
                let _ = done.send(());
            });
        match closing {
            Ok(_) => {
                let _ = closed.await;
            }
            // Dropped here instead: the poll thread leaves the group later.
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a thread to close the kafka consumer")
            }
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.cfg
    }

    /// Offset commits the broker accepted so far.
    pub fn commits(&self) -> u64 {
        self.shared.commits()
    }

    /// The last offset this consumer committed for a partition it owns (the
    /// next one to read, in Kafka's terms).
    pub fn last_committed(&self, topic: &str, partition: i32) -> Option<i64> {
        self.shared.last_committed(topic, partition)
    }

    /// Partitions this consumer gave up on revocation so far (a rebalance
    /// took them, or the consumer is closing).
    pub fn partitions_given_up(&self) -> u64 {
        self.shared.given_up()
    }

    /// Records taken and not yet decided, over the partitions owned.
    pub fn undecided(&self) -> usize {
        self.shared.undecided()
    }

    /// The underlying librdkafka consumer (assignment, positions, committed
    /// offsets…). Do not commit through it: the adapter owns the offsets.
    pub fn client(&self) -> &BaseConsumer<impl rdkafka::consumer::ConsumerContext> {
        &*self.consumer
    }

    /// Handles records until `shutdown` completes, committing decided
    /// offsets every [`KafkaConfig::commit_interval`]; returns what it did.
    /// On shutdown it drains: it starts nothing more (a record waiting
    /// between in-process attempts is abandoned at once, undecided), lets
    /// running handlers finish (up to the consumer's
    /// [`drain_timeout`](Consumer::drain_timeout), as every adapter's `run`
    /// does; [`KafkaConfig::revoke_deadline`] is for rebalances) and
    /// commits what is decided (a commit the broker refuses then is tried
    /// again, three tries in all, a commit interval apart). A handler still
    /// running at the deadline is dropped: its offset stays uncommitted and its idem key
    /// keeps its lease.
    ///
    /// Records a run ends without deciding (not started yet, paused, or
    /// dropped at the deadline; also when the `run` future itself is
    /// dropped) are kept, and the next `run` of this consumer handles them
    /// first, in the order they arrived, so calling `run` again after a
    /// shutdown (a supervisor restarting the loop) loses nothing and the
    /// commits move on. A dropped handler's key is still held: that run
    /// waits for its lease to end and takes over (`Recovered`). If this
    /// consumer is not run again, the partition's next owner reads them
    /// from the last commit and does the same.
    ///
    /// Fails with [`ConsumerError::Config`] if `run` is already running on
    /// this consumer.
    pub async fn run<C, T, E, H, Fut>(
        &self,
        consumer: &Consumer<C>,
        handler: &H,
        shutdown: impl Future,
    ) -> Result<KafkaReport, ConsumerError>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let mut rx = self.rx.try_lock().map_err(|_| {
            ConsumerError::Config("KafkaConsumer::run is already running on this consumer".into())
        })?;
        let mut shutdown = pin!(shutdown);
        let mut report = KafkaReport::default();
        let mut waiting = Backlog {
            queue: StartQueue::default(),
            owner: self,
        };
        // What the last run left undecided goes first, in arrival order, as
        // if it had just come from the channel: the tracker and the
        // partitions' in-flight counts hold each such record once (taken,
        // undecided, not in flight), so it is begun, decided and released
        // once here. One of a partition given up meanwhile is refused by
        // `begin` (the next owner reads it from the commit).
        let kept = self.take_kept();
        if !kept.is_empty() {
            tracing::info!(
                records = kept.len(),
                "handling first the records the last run left undecided"
            );
        }
        for taken in kept {
            waiting.queue.push(self.gated(consumer, taken));
        }
        // Where the running futures hand each record back once decided
        // (made first: they borrow it).
        let (to_land, mut landed) = mpsc::unbounded_channel();
        let mut running = FuturesUnordered::new();
        // Records started and not yet decided: a turn's future holds many.
        let mut in_flight = 0usize;
        let mut ticker = tokio::time::interval(self.cfg.commit_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let limit = consumer.batch_concurrency();
        let mut closed = false;
        let mut committing: Option<tokio::task::JoinHandle<()>> = None;
        self.shared.set_closing(false);
        loop {
            // Start what the gate rule lets start, as one batch. A record
            // of a partition revoked meanwhile is dropped (the next owner
            // reads it from the last commit).
            let room = limit.saturating_sub(in_flight);
            let mut started = Vec::new();
            for w in waiting.queue.start(room, |w| self.shared.begin(&w.taken)) {
                report.fetched += 1;
                if w.taken.msg.delivery_count() > 1 {
                    report.redelivered += 1;
                }
                let Waiting {
                    taken,
                    key,
                    fingerprint,
                    gates,
                } = w;
                started.push(Started {
                    held: Held::new(self, taken),
                    key,
                    fingerprint,
                    gates,
                });
            }
            if !started.is_empty() {
                in_flight += started.len();
                running.push(Either::Left(
                    self.turn(consumer, handler, started, &to_land),
                ));
            }
            let room = !closed && waiting.queue.len() < self.cfg.buffer;
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                Some(after) = landed.recv() => {
                    // The whole wave: a round trip of results lands many
                    // records at once, and the room they leave starts as
                    // one turn, not as turns of one.
                    let mut next = Some(after);
                    while let Some(after) = next {
                        if let Some(again) = self.land(after, &mut waiting.queue, &mut report, &mut in_flight) {
                            running.push(Either::Right(self.resume(consumer, handler, again, &to_land)));
                        }
                        next = landed.try_recv().ok();
                    }
                }
                Some(()) = running.next(), if !running.is_empty() => {}
                Some(_) = OptionFuture::from(committing.as_mut()), if committing.is_some() => {
                    committing = None;
                }
                taken = rx.recv(), if room => match taken {
                    Some(taken) => {
                        waiting.queue.push(self.gated(consumer, taken));
                        // What else the poll thread has sent goes in the
                        // same turn: started one by one, records would
                        // make batches of one.
                        while waiting.queue.len() < self.cfg.buffer {
                            let Ok(taken) = rx.try_recv() else { break };
                            waiting.queue.push(self.gated(consumer, taken));
                        }
                    }
                    None => closed = true,
                },
                _ = ticker.tick(), if committing.is_none() => {
                    committing = self.start_commit();
                    if closed && in_flight == 0 {
                        return Err(ConsumerError::broker(
                            BROKER,
                            "poll",
                            "the polling thread stopped",
                        ));
                    }
                }
            }
        }
        // Shutdown drains: nothing new starts, not even another attempt of
        // a record in flight (a paused one is abandoned at once); running
        // handlers get the consumer's drain deadline; then whatever is decided is
        // committed. A handler dropped at the deadline keeps its idem lease
        // and its offset stays uncommitted. Every record left undecided is
        // kept for the next run (see `kept`).
        self.shared.set_closing(true);
        let end = Instant::now() + consumer.drain_deadline();
        while in_flight > 0 {
            tokio::select! {
                biased;
                Some(after) = landed.recv() => {
                    if let Some(again) = self.land(after, &mut waiting.queue, &mut report, &mut in_flight) {
                        running.push(Either::Right(self.resume(consumer, handler, again, &to_land)));
                    }
                }
                Some(()) = running.next(), if !running.is_empty() => {}
                _ = tokio::time::sleep_until(end) => {
                    tracing::warn!(
                        in_flight,
                        "shutdown with handlers still running; their records stay uncommitted"
                    );
                    break;
                }
            }
        }
        // Each dropped handler's `Held` releases its record from the
        // in-flight count and keeps it; then the records that never
        // started are kept after them (the next run sorts them back into
        // arrival order).
        drop(running);
        // Decided before the deadline, still on their way: accounted for;
        // one that was to go on alone is kept (its `Held` drops).
        while let Ok(after) = landed.try_recv() {
            drop(self.land(after, &mut waiting.queue, &mut report, &mut in_flight));
        }
        report.abandoned += in_flight;
        self.keep(waiting.queue.drain().map(|w| w.taken));
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).len();
        if kept > 0 {
            tracing::info!(
                records = kept,
                "records left undecided, kept for the next run of this consumer"
            );
        }
        if let Some(c) = committing.take() {
            let _ = c.await;
        }
        // The run's last commit: no interval follows to try it again, so a
        // refused one (a rebalance under way, a broker busy) is tried again
        // here a few times. What still fails is read again by the next
        // owner from the last commit, and idem replays it.
        for attempt in 1..=LAST_COMMIT_TRIES {
            let Some(c) = self.start_commit() else { break };
            let _ = c.await;
            if attempt < LAST_COMMIT_TRIES && !self.shared.to_commit().is_empty() {
                tokio::time::sleep(self.cfg.commit_interval).await;
            }
        }
        Ok(report)
    }

    /// Accounts for a record a running future handed back: finished when
    /// done, or returned to go on alone.
    fn land<'a>(
        &self,
        after: After<'a>,
        waiting: &mut StartQueue<Waiting>,
        report: &mut KafkaReport,
        in_flight: &mut usize,
    ) -> Option<Again<'a>> {
        match after {
            After::Done(done) => {
                *in_flight = in_flight.saturating_sub(1);
                self.finish(done, waiting, report);
                None
            }
            After::Again(again) => Some(again),
        }
    }

    /// Keeps records this run ends without deciding, for the next run;
    /// those of a partition no longer ours are the next owner's.
    fn keep(&self, records: impl IntoIterator<Item = Taken>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.extend(records.into_iter().filter(|t| self.shared.owns(t)));
    }

    /// The records the last run kept, in arrival order.
    fn take_kept(&self) -> Vec<Taken> {
        let mut kept = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|p| p.into_inner()));
        kept.sort_by_key(|t| t.seq);
        kept
    }

    /// Keys and gates of a record just taken.
    fn gated<C>(&self, consumer: &Consumer<C>, taken: Taken) -> Waiting {
        let (key, fingerprint) = consumer.key_and_fingerprint_of(&taken.msg);
        let mut gates = Gates::default();
        if let Ok(k) = &key {
            gates.push(self.gate_seed.hash_one(("k", k.as_str())));
        }
        if self.cfg.in_order_per_key
            && let Some(rk) = &taken.record_key
        {
            gates.push(self.gate_seed.hash_one((
                "r",
                &*taken.topic,
                taken.partition,
                rk.as_slice(),
            )));
        }
        Waiting {
            taken,
            key,
            fingerprint,
            gates,
        }
    }

    fn finish(&self, done: Done<'_>, waiting: &mut StartQueue<Waiting>, report: &mut KafkaReport) {
        let Done {
            mut held,
            gates,
            end,
            report: handled,
        } = done;
        waiting.release(gates.as_slice());
        report.add(handled);
        // Accounted for below: its drop does nothing more.
        held.settled = true;
        let t = &held.taken;
        match end {
            End::Abandoned => {
                report.abandoned += 1;
                self.shared.abandon(t);
                // Stopped by a shutdown, its partition still ours: the next
                // run handles it. Stopped by a revocation: `keep` leaves it
                // to the next owner.
                self.keep([t.clone()]);
            }
            End::Acked | End::Moved(_) => {
                match &end {
                    End::Acked => report.acked += 1,
                    End::Moved(Destination::Retry(_)) => report.retry_published += 1,
                    _ => report.dead_lettered += 1,
                }
                if !self.shared.decide(t) {
                    tracing::debug!(
                        topic = &*t.topic,
                        partition = t.partition,
                        offset = t.offset,
                        "decided after its partition was given up; the next owner replays it"
                    );
                }
            }
        }
    }

    /// Starts a commit of what the commit rule allows, on a blocking
    /// thread (librdkafka's synchronous commit), so the handlers keep
    /// running meanwhile; `None` when there is nothing new to commit.
    fn start_commit(&self) -> Option<tokio::task::JoinHandle<()>> {
        let list = self.shared.to_commit();
        if list.is_empty() {
            return None;
        }
        let (consumer, shared) = (self.consumer.clone(), self.shared.clone());
        let running = shared.commit_running();
        Some(tokio::task::spawn_blocking(move || {
            tracing::debug!(offsets = ?list, "committing decided offsets");
            match consumer.commit(&offsets_list(&list), CommitMode::Sync) {
                Ok(()) => shared.committed(&list),
                Err(e) => {
                    shared.commit_failed();
                    tracing::warn!(error = %e, "offset commit failed; retried at the next interval");
                }
            }
            // The consumer first: `close` drops the last handle once no
            // commit runs.
            drop(consumer);
            drop(running);
        }))
    }
}

fn offsets_list(list: &[(String, i32, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(list.len());
    for (topic, partition, offset) in list {
        if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset)) {
            tracing::warn!(error = %e, "cannot list an offset to commit");
        }
    }
    tpl
}
