//! Amazon SQS adapter (`aws-sdk-sqs`): `ReceiveMessage` in batches with
//! long polling, visibility extended while handlers run, `DeleteMessageBatch`
//! on ack, visibility changed on nack, dead letters sent (with idem's
//! reason) to the queue's dead-letter queue; FIFO queues in order per
//! message group.
//!
//! | idem's decision | what the adapter does |
//! | --- | --- |
//! | ack (executed, replayed, recovered) | `DeleteMessageBatch` (up to 10 a request) |
//! | nack with a delay | `ChangeMessageVisibility` to the delay, rounded to the nearest second (0: visible again at once), at most 12 h |
//! | dead-letter | `SendMessageBatch` to the dead-letter queue with idem's fields as message attributes, then delete; a send that fails leaves the message in the queue |
//!
//! **Keys.** Every message gets an id ([`Message::id`]), the first of:
//! the string message attribute [`SqsConfig::id_attribute`] (default
//! [`ID_ATTRIBUTE`], `idem-id`, where [`SqsSink`](crate::outbox::SqsSink)
//! puts the outbox message's id); on a FIFO queue, the message's
//! `MessageDeduplicationId` (the producer's, or SQS's SHA-256 of the body
//! on a queue with content-based deduplication); otherwise SQS's own
//! `MessageId`. The [`Consumer`](crate::Consumer)'s
//! [`KeySource`](crate::KeySource) then makes the key from it (the
//! default, `IdOrPayload`, uses the id); give it a
//! [`KeySource::Payload`](crate::KeySource) when producers re-send one
//! event as new messages, or a [`KeySource::custom`](crate::KeySource::custom)
//! that reads a field. SQS's `MessageId` is new for every `SendMessage`:
//! on a standard queue it catches SQS's own duplicate deliveries (at least
//! once) and redeliveries, not a producer that sends twice. An id
//! attribute that is not a string (`Binary`) dead-letters the message as
//! unreadable rather than keying it on something else.
//!
//! **Visibility is the lease's keep-alive.** Messages are received with
//! [`SqsConfig::visibility_timeout`] (default 30 s) and, while a batch's
//! handlers run, `ChangeMessageVisibilityBatch` sets it again every third
//! of it (or every third of idem's lease, if shorter: the crate's
//! heartbeat, [`with_heartbeat`](crate::with_heartbeat)), so SQS hands no
//! message of a live handler to another consumer however long it takes
//! (up to SQS's 12 hours from the receive). A consumer that dies stops
//! extending: its messages come back after the timeout, and idem answers
//! them as it answers every redelivery (replay, `InProgress` while the
//! dead holder's lease lives, then `Recovered`). The delivery count is
//! SQS's `ApproximateReceiveCount`.
//!
//! **Dead letters.** The dead-letter queue is [`SqsConfig::dead_letter_queue_url`],
//! or else the one the queue's redrive policy names (`deadLetterTargetArn`,
//! read by [`SqsConsumer::new`]); a queue with neither is a
//! [`ConsumerError::Config`]: a message idem gives up on would have nowhere
//! to go. The adapter sends the dead letter itself, so that it carries
//! idem's fields as string message attributes (`idem-reason`, `idem-kind`,
//! `idem-deliveries`, `idem-failures`: [`DeadLetterReason::fields`]) beside
//! the original's attributes (SQS allows 10 a message: the original's
//! beyond what fits are dropped, with a warning), and deletes the original
//! only once SQS accepted the copy. If the send fails, the original is not
//! deleted: it stays invisible for [`DEAD_LETTER_RETRY`] and is handled
//! again then, so nothing is lost. Keep the redrive policy's
//! `maxReceiveCount` above [`Consumer::max_deliveries`](crate::Consumer::max_deliveries)
//! (default 100), so that idem decides (with its reason) and SQS's own
//! redrive stays the backstop for a message that kills its consumer every
//! time.
//!
//! **FIFO queues** (a URL ending in `.fifo`, or the queue's `FifoQueue`
//! attribute): SQS returns a group's messages in order and no more of a
//! group while one of its messages is in flight, but one receive may hold
//! several messages of one group. The adapter runs at most one message of
//! a group at a time, in order: a received batch is handed to the core in
//! waves, the first message of each group, then the second, … each wave
//! settled before the next starts. The later messages wait in the adapter
//! (their visibility extended with the running wave's). When a message is
//! not deleted (nacked, or its dead letter failed), the messages of its
//! group waiting behind it are made visible again without running, and
//! SQS delivers the group again from that message on: never reordered.
//! Messages of different groups run concurrently, as on a standard queue.
//!
//! ```no_run
//! use idem_consumer::sqs::{SqsConfig, SqsConsumer, aws_sdk_sqs};
//! use idem_consumer::{Adapter, Consumer, Message};
//! use idem_core::Idempotency;
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let aws = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
//! let sqs = aws_sdk_sqs::Client::new(&aws);
//! let idem = Idempotency::builder(RedisStore::connect("redis://127.0.0.1/").await?).build();
//! let consumer = Consumer::new(idem, "orders.charge");
//! let url = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo";
//! let orders = SqsConsumer::new(sqs, SqsConfig::new(url).wait(std::time::Duration::from_secs(20))).await?;
//! let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
//! orders.run(&consumer, &charge, std::future::pending::<()>()).await?;
//! # Ok(()) }
//! ```

/// The `aws-sdk-sqs` crate this adapter is built on, re-exported so your
/// client and setup code uses the same version.
pub use aws_sdk_sqs;

use crate::adapter::Adapter;
use crate::decision::{DeadLetterReason, Decision};
use crate::error::{BrokerSource, ConsumerError};
use crate::message::Message;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use bytes::Bytes;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

const BROKER: &str = "sqs";

/// The message attribute the adapter reads a message's id from by default,
/// and where [`SqsSink`](crate::outbox::SqsSink) writes the outbox id.
pub const ID_ATTRIBUTE: &str = "idem-id";

/// How long a message whose dead letter could not be sent stays invisible
/// before it is handled again: long enough not to spin on a missing or
/// refusing dead-letter queue.
pub const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// The most entries SQS takes in one batch request.
const MAX_BATCH: usize = 10;

/// The most message attributes SQS allows on one message.
const MAX_ATTRIBUTES: usize = 10;

/// SQS's longest visibility timeout (12 hours), in seconds.
const MAX_VISIBILITY_SECS: i32 = 43_200;

/// SQS's longest long-poll wait, in seconds.
const MAX_WAIT_SECS: u64 = 20;

/// A failed SDK call as a [`ConsumerError::Broker`] whose text carries the
/// service's code and message (the SDK error's own `Display` says only
/// "service error"), the SDK error kept as its source.
pub(crate) fn sdk_error<E, R>(op: &'static str, e: SdkError<E, R>, hint: &str) -> ConsumerError
where
    E: std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    ConsumerError::Broker {
        broker: BROKER,
        op,
        reason: format!("{}{hint}", DisplayErrorContext(&e)),
        source: Some(BrokerSource::from(
            Box::new(e) as Box<dyn std::error::Error + Send + Sync>
        )),
    }
}

/// Whether a queue URL (or name) names a FIFO queue.
fn is_fifo_url(url: &str) -> bool {
    url.trim_end_matches('/').ends_with(".fifo")
}

/// The queue's name: the last segment of its URL.
fn queue_name(url: &str) -> &str {
    url.trim_end_matches('/').rsplit('/').next().unwrap_or(url)
}

/// Whole seconds for SQS, rounded to the nearest, within 0..=12 h.
fn visibility_secs(d: Duration) -> i32 {
    let secs = d.as_millis().saturating_add(500) / 1000;
    i32::try_from(secs).map_or(MAX_VISIBILITY_SECS, |s| s.min(MAX_VISIBILITY_SECS))
}

/// How to consume a queue.
///
/// ```
/// use idem_consumer::sqs::SqsConfig;
/// use std::time::Duration;
/// let cfg = SqsConfig::new("https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
///     .batch(10)
///     .wait(Duration::from_secs(20))
///     .visibility_timeout(Duration::from_secs(60))
///     .dead_letter_queue_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dead");
/// assert_eq!(cfg.queue_url(), "https://sqs.eu-west-1.amazonaws.com/123456789012/orders");
/// ```
#[derive(Debug, Clone)]
pub struct SqsConfig {
    queue_url: String,
    batch: i32,
    wait: Duration,
    visibility: Duration,
    id_attribute: String,
    dead_letter_queue_url: Option<String>,
}

impl SqsConfig {
    /// Consume the queue at `queue_url`. Defaults: batches of 10 (SQS's
    /// most), long polls of 1 s, a visibility timeout of 30 s, ids from
    /// the [`ID_ATTRIBUTE`] message attribute, the dead-letter queue of the
    /// queue's redrive policy.
    pub fn new(queue_url: impl Into<String>) -> SqsConfig {
        SqsConfig {
            queue_url: queue_url.into(),
            batch: 10,
            wait: Duration::from_secs(1),
            visibility: Duration::from_secs(30),
            id_attribute: ID_ATTRIBUTE.to_owned(),
            dead_letter_queue_url: None,
        }
    }

    /// The queue's URL.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// Messages per `ReceiveMessage` (1 to 10, SQS's limit; default 10).
    ///
    /// ```
    /// let cfg = idem_consumer::sqs::SqsConfig::new("https://sqs.example/1/q").batch(4);
    /// # let _ = cfg;
    /// ```
    pub fn batch(mut self, n: u8) -> Self {
        self.batch = i32::from(n.clamp(1, 10));
        self
    }

    /// How long a receive waits for a first message (long polling, whole
    /// seconds up to 20; default 1 s; 0 is short polling, which SQS
    /// answers from a sample of its servers and may return nothing while
    /// messages wait). Shutdown does not wait for it: a receive in flight
    /// is dropped.
    ///
    /// ```
    /// let cfg = idem_consumer::sqs::SqsConfig::new("https://sqs.example/1/q").wait(std::time::Duration::from_secs(20));
    /// # let _ = cfg;
    /// ```
    pub fn wait(mut self, d: Duration) -> Self {
        self.wait = d.min(Duration::from_secs(MAX_WAIT_SECS));
        self
    }

    /// The visibility timeout set on receive and again, every third of it,
    /// while the handlers run (default 30 s; whole seconds, at least 1 s,
    /// at most 12 h). A consumer that dies leaves its messages invisible
    /// this long: shorter brings them back sooner, and costs more
    /// extension requests.
    ///
    /// ```
    /// let cfg = idem_consumer::sqs::SqsConfig::new("https://sqs.example/1/q").visibility_timeout(std::time::Duration::from_secs(60));
    /// # let _ = cfg;
    /// ```
    pub fn visibility_timeout(mut self, d: Duration) -> Self {
        self.visibility = d.clamp(
            Duration::from_secs(1),
            Duration::from_secs(MAX_VISIBILITY_SECS.unsigned_abs().into()),
        );
        self
    }

    /// Read the message id from this string message attribute (default
    /// [`ID_ATTRIBUTE`]); a message without it is keyed on its
    /// deduplication id (FIFO) or SQS's message id.
    ///
    /// ```
    /// let cfg = idem_consumer::sqs::SqsConfig::new("https://sqs.example/1/q").id_attribute("order-id");
    /// # let _ = cfg;
    /// ```
    pub fn id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// Send dead letters to this queue instead of the one the queue's
    /// redrive policy names. A FIFO queue's dead-letter queue must be FIFO
    /// too (SQS's rule): the dead letter keeps the group and the
    /// deduplication id of the original.
    ///
    /// ```
    /// let cfg = idem_consumer::sqs::SqsConfig::new("https://sqs.example/1/q")
    ///     .dead_letter_queue_url("https://sqs.example/1/q-dead");
    /// # let _ = cfg;
    /// ```
    pub fn dead_letter_queue_url(mut self, url: impl Into<String>) -> Self {
        self.dead_letter_queue_url = Some(url.into());
        self
    }
}

/// One received SQS message, as the adapter hands it to the core.
///
/// ```
/// # fn demo(d: &idem_consumer::sqs::SqsDelivery) {
/// println!("{} received {} times, group {:?}", d.message_id(), d.receive_count(), d.group_id());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SqsDelivery {
    message_id: String,
    receipt_handle: String,
    body: Bytes,
    receive_count: u32,
    group_id: Option<String>,
    deduplication_id: Option<String>,
    sequence_number: Option<String>,
    attributes: HashMap<String, MessageAttributeValue>,
    /// The id the message is keyed on, or why it cannot be read.
    id: Result<String, String>,
}

impl SqsDelivery {
    /// SQS's id of the message.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The receipt handle of this receive (what deletes it).
    pub fn receipt_handle(&self) -> &str {
        &self.receipt_handle
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// `ApproximateReceiveCount`: receives so far, this one included.
    pub fn receive_count(&self) -> u32 {
        self.receive_count
    }

    /// `MessageGroupId` (FIFO queues).
    pub fn group_id(&self) -> Option<&str> {
        self.group_id.as_deref()
    }

    /// `MessageDeduplicationId` (FIFO queues).
    pub fn deduplication_id(&self) -> Option<&str> {
        self.deduplication_id.as_deref()
    }

    /// `SequenceNumber` (FIFO queues).
    pub fn sequence_number(&self) -> Option<&str> {
        self.sequence_number.as_deref()
    }

    /// The message attributes.
    pub fn attributes(&self) -> &HashMap<String, MessageAttributeValue> {
        &self.attributes
    }

    /// The received message, read; `None` without a receipt handle (it
    /// could not be settled).
    fn read(m: aws_sdk_sqs::types::Message, id_attribute: &str, fifo: bool) -> Option<SqsDelivery> {
        let receipt_handle = m.receipt_handle?;
        let message_id = m.message_id.unwrap_or_default();
        let mut system = m.attributes.unwrap_or_default();
        let attributes = m.message_attributes.unwrap_or_default();
        let receive_count = system
            .get(&MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(1);
        let group_id = system.remove(&MessageSystemAttributeName::MessageGroupId);
        let deduplication_id = system.remove(&MessageSystemAttributeName::MessageDeduplicationId);
        let sequence_number = system.remove(&MessageSystemAttributeName::SequenceNumber);
        let id = match attributes.get(id_attribute) {
            Some(v) if v.data_type.starts_with("String") => match &v.string_value {
                Some(s) => Ok(s.clone()),
                None => Err(format!(
                    "message attribute `{id_attribute}` has no string value"
                )),
            },
            Some(v) => Err(format!(
                "message attribute `{id_attribute}` is of type {}, not a String",
                v.data_type
            )),
            None => Ok(match (&deduplication_id, fifo) {
                (Some(d), true) => d.clone(),
                _ => message_id.clone(),
            }),
        };
        Some(SqsDelivery {
            message_id,
            receipt_handle,
            body: Bytes::from(m.body.unwrap_or_default()),
            receive_count: receive_count.max(1),
            group_id,
            deduplication_id,
            sequence_number,
            attributes,
            id,
        })
    }
}

/// A FIFO message received but waiting for the message before it in its
/// group.
struct Held {
    delivery: SqsDelivery,
    /// When its visibility was last set (received or extended).
    since: Instant,
}

/// The FIFO queue's groups, as this adapter (and its clones) handles them.
#[derive(Default)]
struct Groups {
    /// Received, not yet handed out, in receive order.
    waiting: VecDeque<Held>,
    /// Groups with a message handed out and not settled, with when its
    /// visibility was last set: a handout never settled (a poll dropped
    /// mid-batch) stops counting once that visibility has run out, as SQS
    /// then delivers the message again.
    running: HashMap<String, Instant>,
    /// Groups whose last settled message was not deleted: their waiting
    /// messages go back to SQS unrun.
    blocked: HashSet<String>,
}

/// Where dead letters go.
#[derive(Debug, Clone)]
struct DeadLetterQueue {
    url: String,
    fifo: bool,
}

/// An SQS queue consumer run through idem.
///
/// ```no_run
/// use idem_consumer::sqs::{SqsConfig, SqsConsumer, aws_sdk_sqs};
/// use idem_consumer::{Adapter, Consumer, ConsumerError, Message};
/// use idem_core::Idempotency;
///
/// # async fn demo(client: aws_sdk_sqs::Client, idem: Idempotency) -> Result<(), ConsumerError> {
/// let consumer = Consumer::new(idem, "orders.charge");
/// let url = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders";
/// let orders = SqsConsumer::new(client, SqsConfig::new(url)).await?;
/// let charge = |m: Message| async move { Ok::<_, std::io::Error>(m.payload().len()) };
/// let report = orders.poll(&consumer, &charge).await?; // one batch, settled
/// println!("{} acked, {} nacked", report.acked, report.nacked);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqsConsumer {
    client: Client,
    cfg: Arc<SqsConfig>,
    fifo: bool,
    dead_letters: Arc<DeadLetterQueue>,
    source: Arc<str>,
    groups: Arc<Mutex<Groups>>,
}

impl fmt::Debug for SqsConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsConsumer")
            .field("config", &self.cfg)
            .field("fifo", &self.fifo)
            .field("dead_letter_queue", &self.dead_letters.url)
            .finish_non_exhaustive()
    }
}

impl SqsConsumer {
    /// Reads the queue's attributes (`FifoQueue`, `RedrivePolicy`) and
    /// finds its dead-letter queue: [`SqsConfig::dead_letter_queue_url`],
    /// or the redrive policy's target.
    ///
    /// Errors: the queue cannot be read ([`ConsumerError::Broker`]: it
    /// does not exist, no permission, the endpoint is down), or it has no
    /// dead-letter queue at all ([`ConsumerError::Config`]).
    pub async fn new(client: Client, cfg: SqsConfig) -> Result<SqsConsumer, ConsumerError> {
        let attrs = client
            .get_queue_attributes()
            .queue_url(&cfg.queue_url)
            .attribute_names(QueueAttributeName::FifoQueue)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|e| {
                sdk_error(
                    "get_queue_attributes",
                    e,
                    "; check the queue URL, that the queue exists and that the credentials may \
                     read its attributes (sqs:GetQueueAttributes)",
                )
            })?;
        let attrs = attrs.attributes.unwrap_or_default();
        let fifo = attrs
            .get(&QueueAttributeName::FifoQueue)
            .map_or_else(|| is_fifo_url(&cfg.queue_url), |v| v == "true");
        let dead_letters = match &cfg.dead_letter_queue_url {
            Some(url) => url.clone(),
            None => {
                let policy = attrs.get(&QueueAttributeName::RedrivePolicy);
                let Some(arn) = policy.and_then(|p| dead_letter_target(p)) else {
                    return Err(ConsumerError::Config(format!(
                        "the queue {} has no redrive policy and no dead-letter queue was given: \
                         a message idem dead-letters would have nowhere to go; set a redrive \
                         policy on the queue or SqsConfig::dead_letter_queue_url",
                        cfg.queue_url
                    )));
                };
                queue_url_of_arn(&client, &arn).await?
            }
        };
        if fifo && !is_fifo_url(&dead_letters) {
            return Err(ConsumerError::Config(format!(
                "the queue {} is FIFO but its dead-letter queue {dead_letters} is not: SQS \
                 requires a FIFO queue's dead-letter queue to be FIFO",
                cfg.queue_url
            )));
        }
        Ok(SqsConsumer {
            client,
            fifo,
            dead_letters: Arc::new(DeadLetterQueue {
                fifo: is_fifo_url(&dead_letters),
                url: dead_letters,
            }),
            source: Arc::from(queue_name(&cfg.queue_url)),
            cfg: Arc::new(cfg),
            groups: Arc::default(),
        })
    }

    /// Whether the queue is FIFO (settled in order per message group).
    pub fn is_fifo(&self) -> bool {
        self.fifo
    }

    /// The dead-letter queue's URL.
    pub fn dead_letter_queue_url(&self) -> &str {
        &self.dead_letters.url
    }

    /// The configuration.
    pub fn config(&self) -> &SqsConfig {
        &self.cfg
    }

    fn groups(&self) -> MutexGuard<'_, Groups> {
        self.groups.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One `ReceiveMessage`, read.
    async fn receive(&self) -> Result<Vec<SqsDelivery>, ConsumerError> {
        let wait = i32::try_from(self.cfg.wait.as_secs()).unwrap_or(20);
        let out = self
            .client
            .receive_message()
            .queue_url(&self.cfg.queue_url)
            .max_number_of_messages(self.cfg.batch)
            .wait_time_seconds(wait)
            .visibility_timeout(visibility_secs(self.cfg.visibility))
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| sdk_error("receive", e, ""))?;
        let received = out.messages.unwrap_or_default();
        let n = received.len();
        let read: Vec<SqsDelivery> = received
            .into_iter()
            .filter_map(|m| SqsDelivery::read(m, &self.cfg.id_attribute, self.fifo))
            .collect();
        if read.len() < n {
            tracing::warn!(queue = %self.source, "SQS returned messages without a receipt handle; they come back after their visibility timeout");
        }
        Ok(read)
    }

    /// FIFO: the next wave (one message per group not running) from the
    /// waiting messages, or from a new receive.
    async fn fetch_fifo(&self) -> Result<Vec<SqsDelivery>, ConsumerError> {
        let (wave, stale_wave, release) = self.next_wave();
        self.release(&release).await;
        if !wave.is_empty() {
            if stale_wave {
                let handles: Vec<&str> = wave.iter().map(|d| d.receipt_handle.as_str()).collect();
                self.extend(&handles).await;
            }
            return Ok(wave);
        }
        let received = self.receive().await?;
        let mut groups = self.groups();
        let mut wave = Vec::with_capacity(received.len());
        let now = Instant::now();
        for d in received {
            let group = d.group_id.clone().unwrap_or_default();
            let behind = groups.running.contains_key(&group)
                || groups
                    .waiting
                    .iter()
                    .any(|h| h.delivery.group_id.as_deref().unwrap_or_default() == group);
            if behind {
                groups.waiting.push_back(Held {
                    delivery: d,
                    since: now,
                });
            } else {
                groups.running.insert(group, now);
                wave.push(d);
            }
        }
        Ok(wave)
    }

    /// Takes the next wave off the waiting messages: whether it needs its
    /// visibility set again first, and the messages to give back to SQS
    /// (behind a message that was not deleted, or no longer ours).
    fn next_wave(&self) -> (Vec<SqsDelivery>, bool, Vec<SqsDelivery>) {
        let mut groups = self.groups();
        let now = Instant::now();
        let visibility = self.cfg.visibility;
        groups
            .running
            .retain(|_, since| now.duration_since(*since) < visibility);
        let mut release = Vec::new();
        let mut kept = VecDeque::with_capacity(groups.waiting.len());
        let waiting = std::mem::take(&mut groups.waiting);
        for held in waiting {
            let group = held.delivery.group_id.as_deref().unwrap_or_default();
            if groups.blocked.contains(group) {
                release.push(held.delivery);
            } else if now.duration_since(held.since) + Duration::from_secs(1) >= visibility {
                // Its visibility ran out (extensions failed): SQS may have
                // handed it to another consumer; it is not ours to run.
                tracing::warn!(queue = %self.source, message_id = %held.delivery.message_id, "a FIFO message waited past its visibility timeout; SQS delivers it again");
            } else {
                kept.push_back(held);
            }
        }
        groups.blocked.clear();
        let mut wave = Vec::new();
        let mut stale = false;
        let mut taken: HashSet<String> = HashSet::new();
        let mut rest = VecDeque::with_capacity(kept.len());
        for held in kept {
            let group = held.delivery.group_id.clone().unwrap_or_default();
            if groups.running.contains_key(&group) || taken.contains(&group) {
                rest.push_back(held);
                continue;
            }
            stale |= now.duration_since(held.since) * 3 >= visibility;
            taken.insert(group);
            wave.push(held.delivery);
        }
        groups.running.extend(taken.into_iter().map(|g| (g, now)));
        groups.waiting = rest;
        (wave, stale, release)
    }

    /// Makes messages visible again at once, unrun (logged on failure:
    /// they come back after their visibility timeout anyway).
    async fn release(&self, deliveries: &[SqsDelivery]) {
        if deliveries.is_empty() {
            return;
        }
        let entries: Vec<(&str, i32)> = deliveries
            .iter()
            .map(|d| (d.receipt_handle.as_str(), 0))
            .collect();
        if let Err(e) = self.change_visibility(&entries).await {
            tracing::warn!(queue = %self.source, error = %e, "could not give FIFO messages back behind an unsettled one; they come back after their visibility timeout");
        }
    }

    /// Sets the visibility timeout of `handles` again (keep-alive), logging
    /// failures.
    async fn extend(&self, handles: &[&str]) -> bool {
        let secs = visibility_secs(self.cfg.visibility);
        let entries: Vec<(&str, i32)> = handles.iter().map(|h| (*h, secs)).collect();
        match self.change_visibility(&entries).await {
            Ok(done) if done.iter().all(|ok| *ok) => true,
            Ok(_) => {
                tracing::warn!(queue = %self.source, "SQS refused to extend the visibility of some messages in flight; they may be delivered again meanwhile, and idem answers those InProgress");
                false
            }
            Err(e) => {
                tracing::warn!(queue = %self.source, error = %e, "extending the visibility of messages in flight failed; they may be delivered again meanwhile, and idem answers those InProgress");
                false
            }
        }
    }

    /// `ChangeMessageVisibilityBatch`, 10 entries a request: whether each
    /// entry was changed; `Err` when a request failed as a whole.
    async fn change_visibility(&self, entries: &[(&str, i32)]) -> Result<Vec<bool>, ConsumerError> {
        let requests = entries.chunks(MAX_BATCH).map(|chunk| async move {
            let mut built = Vec::with_capacity(chunk.len());
            for (i, (handle, secs)) in chunk.iter().enumerate() {
                let entry = ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*handle)
                    .visibility_timeout(*secs)
                    .build()
                    .map_err(|e| ConsumerError::broker(BROKER, "change_visibility", e))?;
                built.push(entry);
            }
            let out = self
                .client
                .change_message_visibility_batch()
                .queue_url(&self.cfg.queue_url)
                .set_entries(Some(built))
                .send()
                .await
                .map_err(|e| sdk_error("change_visibility", e, ""))?;
            let failed: HashSet<&str> = out.failed.iter().map(|f| f.id.as_str()).collect();
            for f in &out.failed {
                tracing::debug!(queue = %self.source, code = %f.code, message = f.message.as_deref().unwrap_or(""), "visibility change refused");
            }
            Ok::<_, ConsumerError>(
                (0..chunk.len())
                    .map(|i| !failed.contains(i.to_string().as_str()))
                    .collect::<Vec<bool>>(),
            )
        });
        let mut out = Vec::with_capacity(entries.len());
        let mut first_error = None;
        for (result, chunk) in futures_util::future::join_all(requests)
            .await
            .into_iter()
            .zip(entries.chunks(MAX_BATCH))
        {
            match result {
                Ok(done) => out.extend(done),
                Err(e) => {
                    out.extend(std::iter::repeat_n(false, chunk.len()));
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) if out.iter().all(|ok| !ok) => Err(e),
            Some(e) => {
                tracing::warn!(queue = %self.source, error = %e, "a visibility change request failed");
                Ok(out)
            }
            None => Ok(out),
        }
    }

    /// `DeleteMessageBatch`, 10 a request: whether each was deleted, and
    /// the first failed request's error.
    async fn delete(&self, handles: &[&str]) -> (Vec<bool>, Option<ConsumerError>) {
        let requests = handles.chunks(MAX_BATCH).map(|chunk| async move {
            let mut built = Vec::with_capacity(chunk.len());
            for (i, handle) in chunk.iter().enumerate() {
                let entry = DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*handle)
                    .build()
                    .map_err(|e| ConsumerError::broker(BROKER, "ack", e))?;
                built.push(entry);
            }
            let out = self
                .client
                .delete_message_batch()
                .queue_url(&self.cfg.queue_url)
                .set_entries(Some(built))
                .send()
                .await
                .map_err(|e| sdk_error("ack", e, ""))?;
            for f in &out.failed {
                tracing::warn!(queue = %self.source, code = %f.code, message = f.message.as_deref().unwrap_or(""), "SQS did not delete an acked message; it comes back after its visibility timeout and replays");
            }
            let failed: HashSet<&str> = out.failed.iter().map(|f| f.id.as_str()).collect();
            Ok::<_, ConsumerError>(
                (0..chunk.len())
                    .map(|i| !failed.contains(i.to_string().as_str()))
                    .collect::<Vec<bool>>(),
            )
        });
        let mut out = Vec::with_capacity(handles.len());
        let mut first_error = None;
        for (result, chunk) in futures_util::future::join_all(requests)
            .await
            .into_iter()
            .zip(handles.chunks(MAX_BATCH))
        {
            match result {
                Ok(done) => out.extend(done),
                Err(e) => {
                    out.extend(std::iter::repeat_n(false, chunk.len()));
                    first_error.get_or_insert(e);
                }
            }
        }
        (out, first_error)
    }

    /// Sends dead letters to the dead-letter queue, 10 a request: whether
    /// SQS accepted each.
    async fn send_dead_letters(&self, dead: &[(&SqsDelivery, &DeadLetterReason)]) -> Vec<bool> {
        let requests = dead.chunks(MAX_BATCH).map(|chunk| async move {
            let mut built = Vec::with_capacity(chunk.len());
            for (i, (d, reason)) in chunk.iter().enumerate() {
                built.push(self.dead_letter_entry(i, d, reason)?);
            }
            let out = self
                .client
                .send_message_batch()
                .queue_url(&self.dead_letters.url)
                .set_entries(Some(built))
                .send()
                .await
                .map_err(|e| sdk_error("dead_letter", e, ""))?;
            for f in &out.failed {
                tracing::error!(queue = %self.source, dead_letter_queue = %self.dead_letters.url, code = %f.code, message = f.message.as_deref().unwrap_or(""), "SQS refused a dead letter; the message is kept and handled again");
            }
            let sent: HashSet<&str> = out.successful.iter().map(|s| s.id.as_str()).collect();
            Ok::<_, ConsumerError>(
                (0..chunk.len())
                    .map(|i| sent.contains(i.to_string().as_str()))
                    .collect::<Vec<bool>>(),
            )
        });
        let mut out = Vec::with_capacity(dead.len());
        for (result, chunk) in futures_util::future::join_all(requests)
            .await
            .into_iter()
            .zip(dead.chunks(MAX_BATCH))
        {
            match result {
                Ok(sent) => out.extend(sent),
                Err(e) => {
                    tracing::error!(queue = %self.source, dead_letter_queue = %self.dead_letters.url, error = %e, retry_in_ms = DEAD_LETTER_RETRY.as_millis() as u64, "the dead letters were not sent; the messages are kept and handled again");
                    out.extend(std::iter::repeat_n(false, chunk.len()));
                }
            }
        }
        out
    }

    /// The dead letter of `d`: its body and attributes (as many as fit
    /// beside idem's fields), idem's fields; on a FIFO dead-letter queue,
    /// the original's group and deduplication id.
    fn dead_letter_entry(
        &self,
        i: usize,
        d: &SqsDelivery,
        reason: &DeadLetterReason,
    ) -> Result<SendMessageBatchRequestEntry, ConsumerError> {
        let fields = reason.fields(d.receive_count);
        let room = MAX_ATTRIBUTES.saturating_sub(fields.len());
        let mut originals: Vec<(&String, &MessageAttributeValue)> = d
            .attributes
            .iter()
            .filter(|(k, _)| !fields.iter().any(|(f, _)| f == k))
            .collect();
        originals.sort_by(|a, b| a.0.cmp(b.0));
        if originals.len() > room {
            tracing::warn!(queue = %self.source, message_id = %d.message_id, dropped = originals.len() - room, "SQS allows 10 message attributes: the dead letter drops the original's last ones (by name) to carry idem's fields");
        }
        let mut attributes: HashMap<String, MessageAttributeValue> = originals
            .into_iter()
            .take(room)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, value) in fields {
            let v = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| ConsumerError::broker(BROKER, "dead_letter", e))?;
            attributes.insert(name.to_owned(), v);
        }
        let body = match std::str::from_utf8(&d.body) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(&d.body).into_owned(),
        };
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .message_body(body)
            .set_message_attributes(Some(attributes));
        if self.dead_letters.fifo {
            let group = d
                .group_id
                .clone()
                .unwrap_or_else(|| self.source.to_string());
            let dedup = d
                .deduplication_id
                .clone()
                .unwrap_or_else(|| d.message_id.clone());
            entry = entry
                .message_group_id(group)
                .message_deduplication_id(dedup);
        }
        entry
            .build()
            .map_err(|e| ConsumerError::broker(BROKER, "dead_letter", e))
    }

    /// Applies decisions: dead letters sent first (their originals deleted
    /// with the acks, or kept for [`DEAD_LETTER_RETRY`]), then the deletes
    /// and visibility changes; on a FIFO queue, the groups of messages not
    /// deleted are blocked. Returns the first failed request's error.
    async fn settle_all(&self, decided: &[(&SqsDelivery, &Decision)]) -> Result<(), ConsumerError> {
        let mut deletes: Vec<&SqsDelivery> = Vec::new();
        let mut visibility: Vec<(&SqsDelivery, i32)> = Vec::new();
        let mut dead: Vec<(&SqsDelivery, &DeadLetterReason)> = Vec::new();
        for (d, decision) in decided {
            match decision {
                Decision::Ack => deletes.push(d),
                Decision::Nack { delay } => visibility.push((d, visibility_secs(*delay))),
                Decision::DeadLetter { reason } => dead.push((d, reason)),
            }
        }
        if !dead.is_empty() {
            let sent = self.send_dead_letters(&dead).await;
            for ((d, reason), ok) in dead.iter().zip(sent) {
                if ok {
                    tracing::warn!(queue = %self.source, dead_letter_queue = %self.dead_letters.url, message_id = %d.message_id, reason = %reason, kind = reason.kind(), "dead-lettered");
                    deletes.push(d);
                } else {
                    visibility.push((d, visibility_secs(DEAD_LETTER_RETRY)));
                }
            }
        }
        let delete_handles: Vec<&str> = deletes.iter().map(|d| d.receipt_handle.as_str()).collect();
        let change_entries: Vec<(&str, i32)> = visibility
            .iter()
            .map(|(d, s)| (d.receipt_handle.as_str(), *s))
            .collect();
        let deleting = async {
            if delete_handles.is_empty() {
                (Vec::new(), None)
            } else {
                self.delete(&delete_handles).await
            }
        };
        let changing = async {
            if change_entries.is_empty() {
                Ok(Vec::new())
            } else {
                self.change_visibility(&change_entries).await
            }
        };
        let ((deleted, delete_error), changed) = tokio::join!(deleting, changing);
        if self.fifo {
            let mut groups = self.groups();
            for (d, _) in decided {
                let group = d.group_id.clone().unwrap_or_default();
                groups.running.remove(&group);
            }
            for (d, ok) in deletes.iter().zip(&deleted) {
                if !ok {
                    groups
                        .blocked
                        .insert(d.group_id.clone().unwrap_or_default());
                }
            }
            for (d, _) in &visibility {
                groups
                    .blocked
                    .insert(d.group_id.clone().unwrap_or_default());
            }
        }
        if let Some(e) = delete_error {
            return Err(e);
        }
        changed.map(drop).map_err(|e| match e {
            ConsumerError::Broker { reason, source, .. } => ConsumerError::Broker {
                broker: BROKER,
                op: "nack",
                reason,
                source,
            },
            other => other,
        })
    }
}

/// The dead-letter target of a redrive policy (JSON with
/// `deadLetterTargetArn`).
fn dead_letter_target(policy: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(policy).ok()?;
    v.get("deadLetterTargetArn")?.as_str().map(str::to_owned)
}

/// The URL of the queue an ARN (`arn:aws:sqs:<region>:<account>:<name>`)
/// names.
async fn queue_url_of_arn(client: &Client, arn: &str) -> Result<String, ConsumerError> {
    let mut parts = arn.split(':');
    let (account, name) = (parts.nth(4), parts.next());
    let (Some(account), Some(name)) = (account, name) else {
        return Err(ConsumerError::Config(format!(
            "the redrive policy's deadLetterTargetArn `{arn}` is not an SQS queue ARN \
             (arn:aws:sqs:<region>:<account>:<name>); fix the policy or set \
             SqsConfig::dead_letter_queue_url"
        )));
    };
    let out = client
        .get_queue_url()
        .queue_name(name)
        .queue_owner_aws_account_id(account)
        .send()
        .await
        .map_err(|e| {
            sdk_error(
                "get_queue_url",
                e,
                "; the redrive policy's dead-letter queue cannot be found: create it, fix the \
                 policy, or set SqsConfig::dead_letter_queue_url",
            )
        })?;
    out.queue_url.ok_or_else(|| {
        ConsumerError::broker(
            BROKER,
            "get_queue_url",
            format!("no URL returned for {arn}"),
        )
    })
}

/// `ReceiveMessage` (one message per group at a time on a FIFO queue);
/// `DeleteMessageBatch` on ack; `ChangeMessageVisibilityBatch` on nack and
/// while handlers run; dead letters sent to the dead-letter queue, then
/// deleted (see the [module](self) documentation).
impl Adapter for SqsConsumer {
    type Delivery = SqsDelivery;

    /// Long-polls up to [`SqsConfig::wait`] for up to a batch; on a FIFO
    /// queue, hands out the next wave of messages already received first.
    async fn fetch(&self) -> Result<Vec<SqsDelivery>, ConsumerError> {
        if self.fifo {
            self.fetch_fifo().await
        } else {
            self.receive().await
        }
    }

    fn delivery_count(&self, d: &SqsDelivery) -> u32 {
        d.receive_count
    }

    /// The body, the id (see the [module](self) documentation), the
    /// receive count; on a FIFO queue the position `<group>/<sequence>`;
    /// with `otel`, the string attributes `traceparent` and `tracestate`
    /// (where [`SqsSink`](crate::outbox::SqsSink) puts a message's headers).
    fn message_of(&self, d: &SqsDelivery) -> Result<Message, ConsumerError> {
        let mut msg = Message::new(d.body.clone())
            .with_delivery_count(d.receive_count)
            .with_source(BROKER, self.source.clone());
        if let Some(seq) = &d.sequence_number {
            let group = d.group_id.as_deref().unwrap_or_default();
            msg = msg.with_position(format!("{group}/{seq}"));
        }
        match &d.id {
            Ok(id) => msg = msg.with_id(id.as_str()),
            Err(why) => msg = msg.with_unreadable_id(why.as_str()),
        }
        // Receives ask for every message attribute already (the id's, and
        // the originals a dead letter carries): nothing more to request.
        #[cfg(feature = "otel")]
        {
            msg = crate::otel::with_trace_headers(msg, |name| {
                let v = d.attributes.get(name)?;
                v.data_type
                    .starts_with("String")
                    .then(|| v.string_value.clone())
                    .flatten()
            });
        }
        Ok(msg)
    }

    async fn apply(&self, d: &SqsDelivery, decision: &Decision) -> Result<(), ConsumerError> {
        self.settle_all(&[(d, decision)]).await
    }

    /// One `DeleteMessageBatch` (and one `ChangeMessageVisibilityBatch`, one
    /// `SendMessageBatch` to the dead-letter queue) per 10 deliveries.
    async fn apply_batch(&self, decided: &[(SqsDelivery, Decision)]) -> Result<(), ConsumerError> {
        let refs: Vec<(&SqsDelivery, &Decision)> = decided.iter().map(|(d, x)| (d, x)).collect();
        self.settle_all(&refs).await
    }

    /// A third of the visibility timeout.
    fn keep_alive_period(&self) -> Option<Duration> {
        Some(self.cfg.visibility / 3)
    }

    /// Sets the visibility timeout of the batch in flight again (and of
    /// the FIFO messages waiting behind it).
    async fn keep_alive(&self, in_flight: &[SqsDelivery]) {
        let waiting: Vec<String> = if self.fifo {
            self.groups()
                .waiting
                .iter()
                .map(|h| h.delivery.receipt_handle.clone())
                .collect()
        } else {
            Vec::new()
        };
        let handles: Vec<&str> = in_flight
            .iter()
            .map(|d| d.receipt_handle.as_str())
            .chain(waiting.iter().map(String::as_str))
            .collect();
        let started = Instant::now();
        if self.extend(&handles).await && self.fifo {
            let mut groups = self.groups();
            for d in in_flight {
                let group = d.group_id.as_deref().unwrap_or_default();
                if let Some(since) = groups.running.get_mut(group) {
                    *since = started;
                }
            }
            for held in groups.waiting.iter_mut() {
                if waiting.contains(&held.delivery.receipt_handle) {
                    held.since = started;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nack_delays_round_to_the_nearest_second_within_twelve_hours() {
        assert_eq!(visibility_secs(Duration::ZERO), 0);
        assert_eq!(visibility_secs(Duration::from_millis(20)), 0);
        assert_eq!(visibility_secs(Duration::from_millis(500)), 1);
        assert_eq!(visibility_secs(Duration::from_millis(2400)), 2);
        assert_eq!(
            visibility_secs(Duration::from_secs(100_000)),
            MAX_VISIBILITY_SECS
        );
    }

    #[test]
    fn redrive_policies_and_arns_are_read() {
        let p = r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:123456789012:orders-dead","maxReceiveCount":"5"}"#;
        assert_eq!(
            dead_letter_target(p).as_deref(),
            Some("arn:aws:sqs:us-east-1:123456789012:orders-dead")
        );
        assert_eq!(dead_letter_target("{}"), None);
        assert_eq!(queue_name("https://sqs.x/123/orders.fifo"), "orders.fifo");
        assert!(is_fifo_url("https://sqs.x/123/orders.fifo"));
        assert!(!is_fifo_url("https://sqs.x/123/orders"));
    }

    fn received(
        id: &str,
        attrs: &[(&str, &str, &str)],
        dedup: Option<&str>,
    ) -> aws_sdk_sqs::types::Message {
        let mut m = aws_sdk_sqs::types::Message::builder()
            .message_id(id)
            .receipt_handle(format!("rh-{id}"))
            .body("{}")
            .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "3");
        if let Some(d) = dedup {
            m = m.attributes(MessageSystemAttributeName::MessageDeduplicationId, d);
        }
        for (name, ty, value) in attrs {
            let v = MessageAttributeValue::builder()
                .data_type(*ty)
                .string_value(*value)
                .build()
                .unwrap();
            m = m.message_attributes(*name, v);
        }
        m.build()
    }

    /// The id attribute first, then (FIFO) the deduplication id, then
    /// SQS's message id; an id attribute that is not a string is unreadable.
    #[test]
    fn ids_come_from_the_attribute_then_the_dedup_id_then_the_message_id() {
        let read = |m, fifo| SqsDelivery::read(m, ID_ATTRIBUTE, fifo).unwrap();
        let d = read(
            received("m1", &[(ID_ATTRIBUTE, "String", "o-1")], Some("dd")),
            true,
        );
        assert_eq!((d.id.as_deref(), d.receive_count), (Ok("o-1"), 3));
        assert_eq!(
            read(received("m1", &[], Some("dd")), true).id.as_deref(),
            Ok("dd")
        );
        assert_eq!(
            read(received("m1", &[], Some("dd")), false).id.as_deref(),
            Ok("m1")
        );
        let bad = read(
            received("m1", &[(ID_ATTRIBUTE, "Number", "7")], None),
            false,
        );
        assert!(bad.id.unwrap_err().contains("not a String"));
    }
}
