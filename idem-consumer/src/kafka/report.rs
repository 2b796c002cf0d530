//! [`KafkaReport`]: the counts a [`run`](super::KafkaConsumer::run) returns.

/// What a [`run`](super::KafkaConsumer::run) did.
///
/// ```no_run
/// use idem_consumer::kafka::{KafkaConsumer, KafkaReport};
/// use idem_consumer::{Consumer, ConsumerError, Message};
///
/// # async fn demo(kafka: KafkaConsumer, consumer: Consumer) -> Result<(), ConsumerError> {
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let shutdown = tokio::time::sleep(std::time::Duration::from_secs(60));
/// let report: KafkaReport = kafka.run(&consumer, &charge, shutdown).await?;
/// println!("{} acked ({} duplicates replayed)", report.acked, report.replayed);
/// if report.dead_lettered > 0 {
///     eprintln!("{} records moved to the dead-letter topic", report.dead_lettered);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaReport {
    /// Records taken from the broker and started.
    pub fetched: usize,
    /// Of those, records back from the retry topic (delivery count over 1).
    pub redelivered: usize,
    /// Acked: done, replayed or recovered; their offsets are decided.
    pub acked: usize,
    /// Of those, duplicates answered with the stored result (idem's `Replayed`).
    pub replayed: usize,
    /// Of those, taken over from a holder that died mid-handler (idem's
    /// `Recovered`: the handler ran again once its lease ran out).
    pub recovered: usize,
    /// Handler runs repeated in process after a retryable failure.
    pub retried: usize,
    /// Waits because the handler could not run (store down, key in flight
    /// elsewhere), each followed by another try.
    pub nacked: usize,
    /// Moved to the retry topic.
    pub retry_published: usize,
    /// Moved to the dead-letter topic.
    pub dead_lettered: usize,
    /// Started and left undecided because their partition was revoked or
    /// `run` shut down: after a revocation the next owner handles them;
    /// after a shutdown the next `run` of the same consumer does (or, if
    /// there is none, the next owner); idem replays what was done.
    pub abandoned: usize,
}

impl KafkaReport {
    /// Adds another report's counts to this one.
    pub fn add(&mut self, other: KafkaReport) {
        self.fetched += other.fetched;
        self.redelivered += other.redelivered;
        self.acked += other.acked;
        self.replayed += other.replayed;
        self.recovered += other.recovered;
        self.retried += other.retried;
        self.nacked += other.nacked;
        self.retry_published += other.retry_published;
        self.dead_lettered += other.dead_lettered;
        self.abandoned += other.abandoned;
    }
}
