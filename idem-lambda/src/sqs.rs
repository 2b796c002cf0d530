//! SQS batches on Lambda: each record run once per key through idem-consumer's
//! [`Consumer`], its [`Decision`] turned into a partial batch response.

use crate::deadline::{DEFAULT_STOP_MARGIN, LeasePlan, plan_and_warn};
use aws_lambda_events::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent, SqsMessage};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use idem_consumer::{
    AllRetryable, Classify, Consumer, ConsumerError, DeadLetterReason, Decision, KeySource, Message,
};
use idem_core::{Idempotency, Outcome};
use lambda_runtime::LambdaEvent;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// The attribute SQS sets on a FIFO queue's records: their message group.
pub const MESSAGE_GROUP_ID: &str = "MessageGroupId";
/// The attribute SQS sets on a FIFO queue's records: the producer's (or the
/// content-based) deduplication id.
pub const MESSAGE_DEDUPLICATION_ID: &str = "MessageDeduplicationId";
/// The attribute holding how many times SQS has delivered the record.
pub const APPROXIMATE_RECEIVE_COUNT: &str = "ApproximateReceiveCount";

/// A batch Lambda handed over that cannot be answered record by record.
///
/// Returned as the invocation's error, Lambda redelivers **every** record
/// of the batch (after the visibility timeout); nothing was run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SqsBatchError {
    /// A record has no `messageId`, or an empty one. The partial batch
    /// response names failed records by message id, and Lambda fails the
    /// whole batch when an `itemIdentifier` is empty or unknown, so such a
    /// record could not be reported: SQS always sets it, so the event was
    /// not made by SQS (a hand-written test event, a bad fixture).
    #[error(
        "SQS record {index} has no messageId: its failure could not be reported (Lambda \
         fails the whole batch on an empty itemIdentifier); nothing in the batch was run"
    )]
    MissingMessageId {
        /// The record's index in the event.
        index: usize,
    },
}

impl From<SqsBatchError> for lambda_runtime::Diagnostic {
    fn from(e: SqsBatchError) -> Self {
        lambda_runtime::Diagnostic {
            error_type: "idem_lambda::SqsBatchError".into(),
            error_message: e.to_string(),
        }
    }
}

type KeyFn = dyn Fn(&SqsMessage) -> Result<String, ConsumerError> + Send + Sync;

/// Where a record's idempotency key comes from.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum SqsKey {
    /// FIFO records (those with a `MessageDeduplicationId` attribute): the
    /// deduplication id, which a producer's retry of one send keeps (or
    /// SQS's content hash, with content-based deduplication); others: the
    /// message id. The default.
    ///
    /// SQS deduplicates within 5 minutes; idem for its result TTL. With
    /// content-based deduplication, two sends of the same body a day apart
    /// are then one key (the second replays the first): if identical
    /// bodies can be distinct messages, use [`SqsKey::MessageId`] or a
    /// key of your own.
    #[default]
    Auto,
    /// The message id: SQS's own redeliveries of one message are
    /// duplicates, two sends of the same content are not.
    MessageId,
    /// Your own function (a field of the body, a message attribute…). An
    /// `Err` is a bad message: dead-lettered unrun.
    Custom(Arc<KeyFn>),
}

impl fmt::Debug for SqsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SqsKey::Auto => f.write_str("Auto"),
            SqsKey::MessageId => f.write_str("MessageId"),
            SqsKey::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl SqsKey {
    /// A key from your own function.
    ///
    /// ```
    /// use aws_lambda_events::sqs::SqsMessage;
    /// use idem_consumer::ConsumerError;
    /// let key = idem_lambda::SqsKey::custom(|m: &SqsMessage| {
    ///     let v: serde_json::Value = serde_json::from_str(m.body.as_deref().unwrap_or(""))
    ///         .map_err(|e| ConsumerError::Malformed(e.to_string()))?;
    ///     v["order_id"].as_str().map(str::to_owned).ok_or_else(|| ConsumerError::Malformed("no order_id".into()))
    /// });
    /// let mut m = SqsMessage::default();
    /// m.body = Some(r#"{"order_id":"o-7"}"#.into());
    /// assert_eq!(key.key(&m).unwrap(), "o-7");
    /// ```
    pub fn custom(
        f: impl Fn(&SqsMessage) -> Result<String, ConsumerError> + Send + Sync + 'static,
    ) -> SqsKey {
        SqsKey::Custom(Arc::new(f))
    }

    /// The key of `record`.
    ///
    /// ```
    /// use aws_lambda_events::sqs::SqsMessage;
    /// use idem_lambda::SqsKey;
    /// let mut m = SqsMessage::default();
    /// m.message_id = Some("m-1".into());
    /// assert_eq!(SqsKey::Auto.key(&m).unwrap(), "m-1");
    /// m.attributes.insert("MessageDeduplicationId".into(), "order-7".into());
    /// assert_eq!(SqsKey::Auto.key(&m).unwrap(), "order-7");
    /// assert_eq!(SqsKey::MessageId.key(&m).unwrap(), "m-1");
    /// ```
    pub fn key(&self, record: &SqsMessage) -> Result<String, ConsumerError> {
        let message_id = || {
            record
                .message_id
                .clone()
                .filter(|id| !id.is_empty())
                .ok_or(ConsumerError::MissingId)
        };
        match self {
            SqsKey::Auto => match record.attributes.get(MESSAGE_DEDUPLICATION_ID) {
                Some(dedup) if !dedup.is_empty() => Ok(dedup.clone()),
                _ => message_id(),
            },
            SqsKey::MessageId => message_id(),
            SqsKey::Custom(f) => f(record),
        }
    }
}

type DeadLetterHook =
    dyn Fn(SqsMessage, DeadLetterReason) -> BoxFuture<'static, Result<(), String>> + Send + Sync;

/// What became of one record of the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordStatus {
    /// Done (run now, or replayed): left out of `batchItemFailures`, so
    /// Lambda deletes it.
    Done,
    /// Dead-lettered: the hook set with
    /// [`on_dead_letter`](SqsBatchHandler::on_dead_letter) took it, so it is
    /// left out of `batchItemFailures` and deleted.
    DeadLettered,
    /// Listed in `batchItemFailures`: SQS delivers it again after its
    /// visibility timeout.
    Redeliver(Redeliver),
}

/// Why a record is listed in `batchItemFailures`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Redeliver {
    /// idem-consumer decided `Nack`: a retryable handler error (the key
    /// released), a duplicate in flight (`InProgress`), the store
    /// unavailable.
    Nack,
    /// idem-consumer decided `DeadLetter` and no hook is set: the queue's
    /// redrive policy moves it to its dead-letter queue after
    /// `maxReceiveCount` receives.
    DeadLetter(DeadLetterReason),
    /// The dead-letter hook failed: the record comes back, and so does the
    /// decision.
    DeadLetterHookFailed(String),
    /// FIFO: an earlier record of its message group failed in this batch,
    /// so it was not run (its group's order would break).
    GroupBlocked,
    /// The batch stopped before the invocation's deadline with this record
    /// not finished (a record started is cancelled; its claim lapses with
    /// its lease).
    Deadline,
}

/// One record's report.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RecordReport<T> {
    /// Its message id.
    pub message_id: String,
    /// What became of it.
    pub status: RecordStatus,
    /// What idem-consumer decided, when it ran through it.
    pub decision: Option<Decision>,
    /// What idem did, when the call reached it.
    pub outcome: Option<Outcome>,
    /// The handler's value (run now, or replayed).
    pub value: Option<T>,
    /// The index of an earlier record of the batch, a copy of this one
    /// (same key and body), that was run instead of this one.
    pub copy_of: Option<usize>,
}

impl<T> RecordReport<T> {
    /// True when the record is listed in `batchItemFailures`.
    pub fn is_failure(&self) -> bool {
        matches!(self.status, RecordStatus::Redeliver(_))
    }

    fn status_only(message_id: &str, status: RecordStatus) -> RecordReport<T> {
        RecordReport {
            message_id: message_id.to_owned(),
            status,
            decision: None,
            outcome: None,
            value: None,
            copy_of: None,
        }
    }
}

/// What a batch did: the response for Lambda, and a report per record, in
/// the event's order.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BatchReport<T> {
    /// The partial batch response: every record listed is redelivered, every
    /// other one deleted.
    pub response: SqsBatchResponse,
    /// One report per record of the event.
    pub records: Vec<RecordReport<T>>,
    /// The lease and stop this invocation's deadline gave.
    pub plan: LeasePlan,
}

/// Runs each record of an [`SqsEvent`] once per key and answers Lambda with
/// the records to redeliver (`ReportBatchItemFailures`).
///
/// The records go through idem-consumer's [`Consumer`] (so its settings
/// apply: `max_failures`, `classify`, `fingerprint`, `ttl`, `wait`,
/// `max_deliveries`, with SQS's `ApproximateReceiveCount` as the delivery
/// count), and each [`Decision`] becomes:
///
/// | decision | on Lambda |
/// | --- | --- |
/// | `Ack` (executed, replayed, recovered) | deleted |
/// | `Nack` (retryable error, key released; `InProgress`; store down) | in `batchItemFailures` |
/// | `DeadLetter` (permanent error, `max_failures`, fingerprint mismatch, unkeyable) | with [`on_dead_letter`](SqsBatchHandler::on_dead_letter): the hook, then deleted (in `batchItemFailures` if the hook fails); without: in `batchItemFailures`, left to the queue's redrive policy |
///
/// FIFO queues (records with a `MessageGroupId`): the records of one group
/// run in order, one at a time; once one is listed, the rest of its group
/// in the batch are listed too and not run. Copies of one message (same
/// key and body) in a batch run once and share the first copy's fate.
///
/// ```
/// use aws_lambda_events::sqs::{SqsEvent, SqsMessage};
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_lambda::SqsBatchHandler;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let handler = SqsBatchHandler::new(Idempotency::builder(MemoryStore::new()).build(), "orders.ship");
/// let ship = |m: SqsMessage| async move {
///     match m.body.as_deref() {
///         Some("boom") => Err("carrier down".to_owned()),
///         _ => Ok(format!("shipped {}", m.message_id.unwrap_or_default())),
///     }
/// };
/// let record = |id: &str, body: &str| {
///     let mut m = SqsMessage::default();
///     m.message_id = Some(id.into());
///     m.body = Some(body.into());
///     m
/// };
/// let mut event = SqsEvent::default();
/// event.records = vec![record("m-1", "{}"), record("m-2", "boom")];
/// let report = handler.run(event, None, &ship).await.unwrap();
/// let failed: Vec<_> = report.response.batch_item_failures.iter().map(|f| f.item_identifier.as_str()).collect();
/// assert_eq!(failed, ["m-2"]); // m-1 deleted, m-2 redelivered
/// # });
/// ```
pub struct SqsBatchHandler<C = AllRetryable> {
    consumer: Consumer<C>,
    keys: SqsKey,
    dead_letter: Option<Arc<DeadLetterHook>>,
    stop_margin: std::time::Duration,
    concurrency: usize,
}

impl<C: Clone> Clone for SqsBatchHandler<C> {
    fn clone(&self) -> Self {
        SqsBatchHandler {
            consumer: self.consumer.clone(),
            keys: self.keys.clone(),
            dead_letter: self.dead_letter.clone(),
            stop_margin: self.stop_margin,
            concurrency: self.concurrency,
        }
    }
}

impl<C> fmt::Debug for SqsBatchHandler<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsBatchHandler")
            .field("consumer", &self.consumer)
            .field("keys", &self.keys)
            .field("dead_letter_hook", &self.dead_letter.is_some())
            .field("stop_margin", &self.stop_margin)
            .field("concurrency", &self.concurrency)
            .finish()
    }
}

impl SqsBatchHandler<AllRetryable> {
    /// A handler running records through `idem` under `scope`, with
    /// idem-consumer's defaults (every handler error retryable, 5 handler
    /// failures before a dead letter).
    pub fn new(idem: Idempotency, scope: &str) -> SqsBatchHandler<AllRetryable> {
        SqsBatchHandler::from_consumer(Consumer::new(idem, scope))
    }
}

impl<C> SqsBatchHandler<C> {
    /// A handler over a [`Consumer`] you configured. Its key source is
    /// replaced: keys come from [`keys`](SqsBatchHandler::keys).
    pub fn from_consumer(consumer: Consumer<C>) -> SqsBatchHandler<C> {
        SqsBatchHandler {
            consumer: consumer.keys(KeySource::MessageId),
            keys: SqsKey::Auto,
            dead_letter: None,
            stop_margin: DEFAULT_STOP_MARGIN,
            concurrency: 16,
        }
    }

    /// Where keys come from (default [`SqsKey::Auto`]).
    pub fn keys(mut self, keys: SqsKey) -> Self {
        self.keys = keys;
        self
    }

    /// What to do with a record idem-consumer dead-letters: `hook` gets it
    /// and the reason (send it to a dead-letter queue of your own, store
    /// it…); `Ok` and the record is deleted from the queue, `Err` and it is
    /// listed in `batchItemFailures` (it comes back, and is decided again).
    ///
    /// Without a hook, a dead-lettered record is listed in
    /// `batchItemFailures` and the queue's redrive policy moves it to its
    /// dead-letter queue after `maxReceiveCount` receives; until then each
    /// receive runs the handler again (a permanent error releases the key).
    /// A queue without a redrive policy keeps it until its retention
    /// period ends.
    pub fn on_dead_letter<F, Fut, E>(mut self, hook: F) -> Self
    where
        F: Fn(SqsMessage, DeadLetterReason) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display,
    {
        self.dead_letter = Some(Arc::new(move |m, r| {
            let fut = hook(m, r);
            Box::pin(async move { fut.await.map_err(|e| e.to_string()) })
        }));
        self
    }

    /// How long before the invocation's deadline the batch stops running
    /// records (default [`DEFAULT_STOP_MARGIN`], at most half the time
    /// left): see [`plan`](crate::plan).
    pub fn stop_margin(mut self, margin: std::time::Duration) -> Self {
        self.stop_margin = margin;
        self
    }

    /// Records (FIFO: message groups) run at once (default 16; at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The consumer the records run through.
    pub fn consumer(&self) -> &Consumer<C> {
        &self.consumer
    }

    /// Handles one invocation: the event and its deadline from `event`'s
    /// context, the response for Lambda. Use it in the function given to
    /// `lambda_runtime::service_fn`.
    pub async fn handle<T, E, H, Fut>(
        &self,
        event: LambdaEvent<SqsEvent>,
        handler: &H,
    ) -> Result<SqsBatchResponse, SqsBatchError>
    where
        H: Fn(SqsMessage) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E> + Clone,
    {
        let deadline = crate::deadline::deadline_of(&event.context);
        let report = self.run(event.payload, deadline, handler).await?;
        Ok(report.response)
    }

    /// Handles one batch under `deadline` (`None`: no deadline) and reports
    /// on every record.
    pub async fn run<T, E, H, Fut>(
        &self,
        event: SqsEvent,
        deadline: Option<SystemTime>,
        handler: &H,
    ) -> Result<BatchReport<T>, SqsBatchError>
    where
        H: Fn(SqsMessage) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E> + Clone,
    {
        let records = event.records;
        let mut ids: Vec<&str> = Vec::with_capacity(records.len());
        for (index, r) in records.iter().enumerate() {
            match r.message_id.as_deref() {
                Some(id) if !id.is_empty() => ids.push(id),
                _ => return Err(SqsBatchError::MissingMessageId { index }),
            }
        }
        let plan = plan_and_warn(deadline, self.consumer.call_lease(), self.stop_margin);
        let consumer = self.consumer.clone().lease(plan.lease);
        let keys: Vec<Result<String, ConsumerError>> =
            records.iter().map(|r| self.keys.key(r)).collect();
        let lanes = lanes(&records, &keys);
        let slots: Mutex<Vec<Option<RecordReport<T>>>> =
            Mutex::new((0..records.len()).map(|_| None).collect());
        let batch = Lane::run_all(
            &lanes,
            LaneCtx {
                consumer: &consumer,
                records: &records,
                keys: &keys,
                ids: &ids,
                slots: &slots,
                dead_letter: self.dead_letter.as_deref(),
                handler,
            },
            self.concurrency,
        );
        match plan.stop_after {
            Some(d) => {
                if tokio::time::timeout(d, batch).await.is_err() {
                    tracing::warn!(
                        "the batch stopped before the invocation's deadline: the records not \
                         finished are reported as failures"
                    );
                }
            }
            None => batch.await,
        }
        let slots = slots.into_inner().unwrap_or_else(|p| p.into_inner());
        let reports: Vec<RecordReport<T>> = slots
            .into_iter()
            .zip(&ids)
            .map(|(slot, id)| {
                slot.unwrap_or_else(|| {
                    RecordReport::status_only(id, RecordStatus::Redeliver(Redeliver::Deadline))
                })
            })
            .collect();
        let mut listed: HashSet<String> = HashSet::new();
        let mut response = SqsBatchResponse::default();
        for r in &reports {
            if r.is_failure() && listed.insert(r.message_id.clone()) {
                let mut f = BatchItemFailure::default();
                f.item_identifier = r.message_id.clone();
                response.batch_item_failures.push(f);
            }
        }
        // Copies of one message (same id) share a fate: listing one lists
        // every receipt of it, so none of them may count as done.
        let reports = reports
            .into_iter()
            .map(|mut r| {
                if !r.is_failure() && listed.contains(r.message_id.as_str()) {
                    r.status = RecordStatus::Redeliver(Redeliver::Nack);
                }
                r
            })
            .collect();
        Ok(BatchReport {
            response,
            records: reports,
            plan,
        })
    }
}

/// The records that run one after another: a FIFO message group, or the
/// records of a standard queue that share a key. Indices in event order.
struct Lane {
    fifo: bool,
    records: Vec<usize>,
}

/// Groups the batch into lanes, in the order of their first record.
fn lanes(records: &[SqsMessage], keys: &[Result<String, ConsumerError>]) -> Vec<Lane> {
    let mut out: Vec<Lane> = Vec::new();
    let mut by_name: std::collections::HashMap<(bool, &str), usize> =
        std::collections::HashMap::new();
    for (i, r) in records.iter().enumerate() {
        let (fifo, name) = match r.attributes.get(MESSAGE_GROUP_ID) {
            Some(group) => (true, Some(group.as_str())),
            None => (false, keys.get(i).and_then(|k| k.as_deref().ok())),
        };
        let lane = match name {
            Some(name) => *by_name.entry((fifo, name)).or_insert_with(|| {
                out.push(Lane {
                    fifo,
                    records: Vec::new(),
                });
                out.len() - 1
            }),
            // No key: a lane of its own (dead-lettered unrun).
            None => {
                out.push(Lane {
                    fifo,
                    records: Vec::new(),
                });
                out.len() - 1
            }
        };
        if let Some(l) = out.get_mut(lane) {
            l.records.push(i);
        }
    }
    out
}

struct LaneCtx<'a, C, T, H> {
    consumer: &'a Consumer<C>,
    records: &'a [SqsMessage],
    keys: &'a [Result<String, ConsumerError>],
    ids: &'a [&'a str],
    slots: &'a Mutex<Vec<Option<RecordReport<T>>>>,
    dead_letter: Option<&'a DeadLetterHook>,
    handler: &'a H,
}

impl<C, T, H> Clone for LaneCtx<'_, C, T, H> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<C, T, H> Copy for LaneCtx<'_, C, T, H> {}

impl Lane {
    async fn run_all<C, T, E, H, Fut>(lanes: &[Lane], ctx: LaneCtx<'_, C, T, H>, concurrency: usize)
    where
        H: Fn(SqsMessage) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        futures_util::stream::iter(lanes)
            .for_each_concurrent(concurrency, |lane| lane.run(ctx))
            .await;
    }

    async fn run<C, T, E, H, Fut>(&self, ctx: LaneCtx<'_, C, T, H>)
    where
        H: Fn(SqsMessage) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let mut blocked = false;
        // (index, status) of the records of this lane that ran.
        let mut ran: Vec<(usize, RecordStatus)> = Vec::new();
        for &i in &self.records {
            let (Some(record), Some(key), Some(id)) =
                (ctx.records.get(i), ctx.keys.get(i), ctx.ids.get(i))
            else {
                continue;
            };
            if blocked {
                put(
                    ctx.slots,
                    i,
                    RecordReport::status_only(id, RecordStatus::Redeliver(Redeliver::GroupBlocked)),
                );
                continue;
            }
            let copy = ran
                .iter()
                .find(|(j, _)| is_copy(ctx.records, ctx.keys, *j, i));
            let report = match copy {
                Some((first, status)) => {
                    tracing::debug!(id, "copy of an earlier record of the batch: not run");
                    RecordReport {
                        copy_of: Some(*first),
                        ..RecordReport::status_only(id, status.clone())
                    }
                }
                None => run_record(ctx, record, key, id).await,
            };
            if self.fifo && report.is_failure() {
                blocked = true;
            }
            ran.push((i, report.status.clone()));
            put(ctx.slots, i, report);
        }
    }
}

fn put<T>(slots: &Mutex<Vec<Option<RecordReport<T>>>>, i: usize, report: RecordReport<T>) {
    let mut slots = slots.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(slot) = slots.get_mut(i) {
        *slot = Some(report);
    }
}

/// Whether record `i` is a copy of record `j`: same key and body.
fn is_copy(
    records: &[SqsMessage],
    keys: &[Result<String, ConsumerError>],
    j: usize,
    i: usize,
) -> bool {
    let (Some(Ok(a)), Some(Ok(b))) = (keys.get(j), keys.get(i)) else {
        return false;
    };
    a == b && records.get(j).map(|r| &r.body) == records.get(i).map(|r| &r.body)
}

/// One record through the consumer, its decision mapped for Lambda.
async fn run_record<C, T, E, H, Fut>(
    ctx: LaneCtx<'_, C, T, H>,
    record: &SqsMessage,
    key: &Result<String, ConsumerError>,
    id: &str,
) -> RecordReport<T>
where
    H: Fn(SqsMessage) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize + DeserializeOwned,
    E: fmt::Display,
    C: Classify<E>,
{
    let msg = message_of(record, key, id);
    let handler = ctx.handler;
    let handled = ctx
        .consumer
        .handle(&msg, &|_m: Message| handler(record.clone()))
        .await;
    let status = match &handled.decision {
        Decision::Ack => RecordStatus::Done,
        Decision::Nack { .. } => RecordStatus::Redeliver(Redeliver::Nack),
        Decision::DeadLetter { reason } => match ctx.dead_letter {
            None => {
                tracing::warn!(
                    id,
                    reason = %reason,
                    "record dead-lettered: left to the queue's redrive policy"
                );
                RecordStatus::Redeliver(Redeliver::DeadLetter(reason.clone()))
            }
            Some(hook) => match hook(record.clone(), reason.clone()).await {
                Ok(()) => RecordStatus::DeadLettered,
                Err(e) => {
                    tracing::warn!(id, error = %e, "the dead-letter hook failed: the record comes back");
                    RecordStatus::Redeliver(Redeliver::DeadLetterHookFailed(e))
                }
            },
        },
        // A decision newer than this crate: keep the record.
        _ => RecordStatus::Redeliver(Redeliver::Nack),
    };
    RecordReport {
        message_id: id.to_owned(),
        status,
        decision: Some(handled.decision),
        outcome: handled.outcome,
        value: handled.value,
        copy_of: None,
    }
}

/// The record as idem-consumer's [`Message`]: its key as the id (the
/// consumer keys on it), SQS's receive count as the delivery count.
fn message_of(record: &SqsMessage, key: &Result<String, ConsumerError>, id: &str) -> Message {
    let body = record.body.clone().unwrap_or_default();
    let count = record
        .attributes
        .get(APPROXIMATE_RECEIVE_COUNT)
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(1);
    let queue = record
        .event_source_arn
        .as_deref()
        .and_then(|arn| arn.rsplit(':').next())
        .unwrap_or("")
        .to_owned();
    let msg = Message::new(body)
        .with_delivery_count(count)
        .with_source("sqs", queue)
        .with_position(id);
    match key {
        Ok(k) => msg.with_id(k.clone()),
        Err(e) => msg.with_unreadable_id(e.to_string()),
    }
}
