//! What every relay shares, whatever its store: sending a pass's messages
//! in waves that keep each key's order, the retry backoff, and what a
//! relay reports (a pass, a backlog, a parked message).

use super::message::OutboxMessage;
use super::sink::{Sink, SinkError};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

/// How a relay sends: how long a wave may wait for the broker's
/// confirmations, and how a failed send backs off.
///
/// ```
/// use idem_core::outbox::SendPolicy;
/// use std::time::Duration;
/// let p = SendPolicy::default();
/// assert_eq!(p.backoff(0), Duration::from_millis(200));
/// assert_eq!(p.backoff(1), Duration::from_millis(400));
/// assert_eq!(p.backoff(30), Duration::from_secs(30)); // capped
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendPolicy {
    /// How long one wave may wait for confirmations (default 30 s);
    /// what is unconfirmed then is retried.
    pub send_timeout: Duration,
    /// The first retry delay (default 200 ms), doubling per attempt…
    pub first_backoff: Duration,
    /// …up to this (default 30 s).
    pub max_backoff: Duration,
}

impl Default for SendPolicy {
    fn default() -> Self {
        SendPolicy {
            send_timeout: Duration::from_secs(30),
            first_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
        }
    }
}

impl SendPolicy {
    /// The delay before the next try of a message that failed `attempts`
    /// times before this failure.
    ///
    /// ```
    /// let p = idem_core::outbox::SendPolicy::default();
    /// assert!(p.backoff(3) > p.backoff(2));
    /// ```
    pub fn backoff(&self, attempts: u32) -> Duration {
        self.first_backoff
            .saturating_mul(1u32 << attempts.min(20))
            .min(self.max_backoff.max(self.first_backoff))
    }
}

/// A message a pass could not publish.
#[derive(Debug)]
pub struct Failed<I> {
    /// Where the relay keeps it (a row's `seq`, a stream entry's id).
    pub at: I,
    /// The message.
    pub message: OutboxMessage,
    /// What the sink said.
    pub error: SinkError,
    /// Park it (the broker refused it) rather than retry it.
    pub park: bool,
    /// When to retry it, if not parked.
    pub retry_in: Duration,
}

/// What [`send_in_waves`] did.
#[derive(Debug)]
pub struct Waves<I> {
    /// Where the confirmed messages are kept: delete them.
    pub sent: Vec<I>,
    /// What failed: park or back off, each with its key's later messages.
    pub failed: Vec<Failed<I>>,
    /// The counts, for the relay's report.
    pub report: RelayReport,
}

/// Sends a pass's messages (oldest first, each with where the relay keeps
/// it) in waves: wave `n` holds each key's `n`th message, less the keys
/// whose earlier message failed, and waits for the broker's confirmation
/// of each (bounded by the policy's send timeout) before the next. So a
/// key's next message goes only after the previous one was confirmed, and
/// a failed one holds its key's later ones back.
///
/// ```
/// use async_trait::async_trait;
/// use idem_core::outbox::{OutboxMessage, SendPolicy, Sink, SinkError, send_in_waves};
///
/// struct Refuses(&'static str);
/// #[async_trait]
/// impl Sink for Refuses {
///     async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
///         batch.iter().map(|m| if m.id == self.0 { Err(SinkError::refused("too large")) } else { Ok(()) }).collect()
///     }
///     fn describe(&self) -> String { "test".into() }
/// }
///
/// let msg = |id: &str, key: &str| OutboxMessage::new(id, "t", key, "{}");
/// let pass = vec![(1, msg("a1", "a")), (2, msg("b1", "b")), (3, msg("a2", "a"))];
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let waves = send_in_waves(&Refuses("a1"), &SendPolicy::default(), pass).await;
/// assert_eq!(waves.sent, vec![2]); // a2 waits behind the parked a1
/// assert_eq!(waves.failed[0].at, 1);
/// assert!(waves.failed[0].park);
/// # });
/// ```
pub async fn send_in_waves<S: Sink + ?Sized, I>(
    sink: &S,
    policy: &SendPolicy,
    items: Vec<(I, OutboxMessage)>,
) -> Waves<I> {
    let mut waves: Vec<Vec<usize>> = Vec::new();
    {
        let mut depth: HashMap<&str, usize> = HashMap::new();
        for (i, (_, m)) in items.iter().enumerate() {
            let d = depth.entry(m.key.as_str()).or_insert(0);
            if waves.len() <= *d {
                waves.push(Vec::new());
            }
            waves[*d].push(i);
            *d += 1;
        }
    }
    let mut items: Vec<Option<(I, OutboxMessage)>> = items.into_iter().map(Some).collect();
    let mut stopped: HashSet<String> = HashSet::new();
    let mut out = Waves {
        sent: Vec::new(),
        failed: Vec::new(),
        report: RelayReport::default(),
    };
    for wave in waves {
        let mut at = Vec::with_capacity(wave.len());
        let mut batch = Vec::with_capacity(wave.len());
        for i in wave {
            match items[i].take() {
                Some((where_, m)) if !stopped.contains(&m.key) => {
                    at.push(where_);
                    batch.push(m);
                }
                _ => {}
            }
        }
        if batch.is_empty() {
            continue;
        }
        let results = send_bounded(sink, policy.send_timeout, &batch).await;
        for ((where_, m), result) in at.into_iter().zip(batch).zip(results) {
            match result {
                Ok(()) => {
                    out.sent.push(where_);
                    out.report.sent += 1;
                }
                Err(error) => {
                    let park = !error.is_retryable();
                    let retry_in = policy.backoff(m.attempts);
                    if park {
                        out.report.parked += 1;
                        tracing::warn!(id = %m.id, topic = %m.topic, key = %m.key, reason = %error.reason(), "outbox message parked: the broker refused it; the key's later messages wait (`idem outbox list|retry|drop`)");
                    } else {
                        out.report.failed += 1;
                        out.report.retry_in =
                            Some(out.report.retry_in.map_or(retry_in, |r| r.min(retry_in)));
                        tracing::debug!(id = %m.id, topic = %m.topic, error = %error, ?retry_in, "outbox send failed; retrying");
                    }
                    stopped.insert(m.key.clone());
                    out.failed.push(Failed {
                        at: where_,
                        message: m,
                        error,
                        park,
                        retry_in,
                    });
                }
            }
        }
    }
    out
}

/// One wave, bounded by the send timeout; a sink that answers the wrong
/// number of results fails the messages it did not answer for.
async fn send_bounded<S: Sink + ?Sized>(
    sink: &S,
    limit: Duration,
    batch: &[OutboxMessage],
) -> Vec<Result<(), SinkError>> {
    // A timeout answers nothing: every message is then unconfirmed.
    let send = tokio::time::timeout(limit, sink.send(batch));
    #[cfg(feature = "otel")]
    let send = tracing::Instrument::instrument(send, crate::otel::send_span(sink.system(), batch));
    let mut results = send.await.unwrap_or_default();
    results.truncate(batch.len());
    while results.len() < batch.len() {
        results.push(Err(SinkError::unavailable(format!(
            "{} did not confirm within {limit:?}",
            sink.describe()
        ))));
    }
    results
}

/// What a relay did: one pass (`drain_once`) or a whole run.
///
/// ```
/// use idem_core::outbox::RelayReport;
/// let r = RelayReport { sent: 3, parked: 1, failed: 0, retry_in: None };
/// assert_eq!(r.handled(), 4);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayReport {
    /// Messages the broker confirmed (and the relay deleted).
    pub sent: u64,
    /// Messages the broker refused, now parked.
    pub parked: u64,
    /// Failed sends that will be retried.
    pub failed: u64,
    /// The earliest retry this pass scheduled.
    pub retry_in: Option<Duration>,
}

impl RelayReport {
    /// Adds another pass's counts; the earliest retry wins.
    ///
    /// ```
    /// use idem_core::outbox::RelayReport;
    /// let mut total = RelayReport::default();
    /// total.add(RelayReport { sent: 2, ..Default::default() });
    /// total.add(RelayReport { sent: 1, ..Default::default() });
    /// assert_eq!(total.sent, 3);
    /// ```
    pub fn add(&mut self, other: RelayReport) {
        self.sent += other.sent;
        self.parked += other.parked;
        self.failed += other.failed;
        self.retry_in = match (self.retry_in, other.retry_in) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Messages the pass sent, parked or failed: zero when it found nothing.
    ///
    /// ```
    /// assert_eq!(idem_core::outbox::RelayReport::default().handled(), 0);
    /// ```
    pub fn handled(&self) -> u64 {
        self.sent + self.parked + self.failed
    }
}

/// A parked message: the broker refused it, and its key waits behind it.
///
/// ```
/// use idem_core::outbox::Parked;
/// # fn show(parked: &[Parked]) {
/// for m in parked {
///     eprintln!("{} to {} (key {}, {} attempts): {}", m.id, m.topic, m.key, m.attempts,
///         m.reason.as_deref().unwrap_or("?"));
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parked {
    /// The message id.
    pub id: String,
    /// Where it was going.
    pub topic: String,
    /// Its ordering key (the key's later messages wait behind it).
    pub key: String,
    /// Payload size in bytes.
    pub size: u64,
    /// Failed sends, the refusal included.
    pub attempts: u32,
    /// The sink's reason.
    pub reason: Option<String>,
    /// When it was published (committed).
    pub created_at: SystemTime,
    /// When it was parked.
    pub parked_at: Option<SystemTime>,
}

/// What waits in an outbox.
///
/// ```
/// use idem_core::outbox::Backlog;
/// use std::time::Duration;
/// # fn check(b: Backlog) {
/// let lag = b.oldest.unwrap_or_default();
/// if lag > Duration::from_secs(60) || b.parked > 0 {
///     eprintln!("{} waiting (oldest {lag:?}), {} parked: is the relay up?", b.pending, b.parked);
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Backlog {
    /// Messages waiting to be sent (backing-off ones included).
    pub pending: u64,
    /// Parked messages.
    pub parked: u64,
    /// Age of the oldest pending message.
    pub oldest: Option<Duration>,
}
