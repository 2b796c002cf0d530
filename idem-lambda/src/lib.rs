//! # idem-lambda
//!
//! [idem](https://docs.rs/idem) on AWS Lambda. Re-exported by the `idem`
//! crate as `idem::lambda` (feature `lambda`).
//!
//! - [`SqsBatchHandler`]: an SQS event source's batch, each record run
//!   once per key (its message id; a FIFO record's deduplication id; or
//!   your function) through idem-consumer's [`Consumer`](idem_consumer::Consumer),
//!   answered with the partial batch response (`ReportBatchItemFailures`)
//!   that lists exactly the records to redeliver.
//! - [`http`]: idem-http's IETF `Idempotency-Key` layer on `lambda_http`
//!   (API Gateway REST and HTTP APIs, function URLs, ALB).
//! - [`plan`]: the rule that bounds each call's lease by the invocation's
//!   deadline.
//!
//! ```
//! use aws_lambda_events::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_lambda::SqsBatchHandler;
//! use lambda_runtime::{LambdaEvent, service_fn};
//!
//! async fn ship(m: SqsMessage) -> Result<String, std::io::Error> {
//!     // … the side effect: runs once per message …
//!     Ok(format!("shipped {}", m.message_id.unwrap_or_default()))
//! }
//!
//! async fn main_() -> Result<(), lambda_runtime::Error> {
//!     // A RedisStore (or DynamoDB) in production: Lambda runs many copies.
//!     let idem = Idempotency::builder(MemoryStore::new()).namespace("orders").build();
//!     let batch = SqsBatchHandler::new(idem, "orders.ship");
//!     lambda_runtime::run(service_fn(|event: LambdaEvent<SqsEvent>| {
//!         let batch = batch.clone();
//!         async move { batch.handle(event, &ship).await }
//!     }))
//!     .await
//! }
//! # let _ = main_;
//! ```
//!
//! ## From idem's decision to `batchItemFailures`
//!
//! | idem-consumer decides | the record |
//! | --- | --- |
//! | `Ack`: executed, replayed (a redelivery), recovered (took over a dead invocation's key) | deleted (not listed) |
//! | `Nack`: retryable handler error (key released, failure counted), store unavailable | listed: redelivered after the visibility timeout |
//! | `Nack`: a duplicate in flight (`InProgress`) | listed (see below) |
//! | `DeadLetter`: permanent error, `max_failures` reached, fingerprint mismatch, no usable key | with [`on_dead_letter`](SqsBatchHandler::on_dead_letter): the hook, then deleted (listed if the hook fails); without: listed, left to the queue's redrive policy |
//! | FIFO: an earlier record of its message group is listed | listed, not run |
//! | not finished when the batch stops before the deadline | listed |
//!
//! A record without a `messageId` makes the whole invocation fail with
//! [`SqsBatchError::MissingMessageId`] (before anything runs): its
//! failure could not be listed, and an empty `itemIdentifier` makes Lambda
//! fail the whole batch anyway.
//!
//! **A duplicate in flight.** Two invocations can hold copies of one
//! message at once (standard queues deliver at least once). The second
//! gets `InProgress` and lists its copy, which raises the message's
//! receive count by one. The first invocation's claim has a lease bounded
//! by its deadline ([`plan`]), and renewals only happen while it runs, so
//! once the copy comes back (after the visibility timeout, which Lambda
//! requires to be at least the function's timeout; AWS recommends six
//! times it) the first has either stored its result (the copy replays and
//! is deleted) or stopped renewing, its claim lapsing within one lease of
//! its end (the copy takes the key over). Each copy in flight thus costs
//! one receive, not a loop: keep the redrive policy's `maxReceiveCount` at
//! a few receives above `max_failures` (AWS recommends at least 5), and a
//! message that succeeded is never dead-lettered for having been seen in
//! flight. (An in-progress marker whose expiry is the whole result TTL,
//! as in AWS Powertools without `register_lambda_context`, answers
//! "in progress" to every redelivery after a timed-out invocation until
//! the redrive policy dead-letters the message.) `Consumer::wait` trades
//! the extra receive for invocation time: the copy waits for the first's
//! result.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod deadline;
pub mod http;
mod sqs;

pub use deadline::{DEFAULT_STOP_MARGIN, LeasePlan, LeaseSource, deadline_of, plan};
pub use sqs::{
    APPROXIMATE_RECEIVE_COUNT, BatchReport, MESSAGE_DEDUPLICATION_ID, MESSAGE_GROUP_ID,
    RecordReport, RecordStatus, Redeliver, SqsBatchError, SqsBatchHandler, SqsKey,
};

pub use aws_lambda_events;
pub use idem_consumer;
pub use lambda_runtime;
