//! # idem-consumer
//!
//! Exactly-once side effects for **at-least-once message consumers**, on
//! [idem](https://docs.rs/idem).
//!
//! Brokers redeliver: a consumer that crashes after its side effect but
//! before its ack gets the message again, and so may another consumer that
//! sees it go stale. This crate runs each message's handler through idem
//! (any [`Store`](idem_core::store::Store): Redis, memory…) keyed on the message id
//! or a hash of its payload, so the handler runs **once per key** and every
//! redelivery replays its result, then returns a [`Decision`] (ack, nack
//! with delay, dead-letter with a reason) for the adapter to apply.
//!
//! The core is broker-agnostic ([`Consumer`], [`Message`], [`Decision`]);
//! adapters are thin implementations of one trait, [`Adapter`] (fetch a
//! batch, read a delivery as a [`Message`], apply a [`Decision`]), which
//! brings the same `poll` and `run` loop to every broker; a Pulsar adapter
//! fits in a page (see its documentation):
//!
//! * `redis-streams`: [`redis_streams::RedisStreamsConsumer`]: consumer
//!   groups, `XREADGROUP`, `XACK`, stale entries via `XAUTOCLAIM`, dead-letter
//!   stream;
//! * `nats`: [`nats::NatsConsumer`]: JetStream pull consumers with progress
//!   acks, nak with delay, term and a dead-letter subject;
//! * `rabbitmq`: [`rabbitmq::RabbitConsumer`]: `basic_ack`, delayed
//!   `basic_nack` with requeue, dead letters published (with idem's reason
//!   and counts, under publisher confirms) to a dead-letter exchange;
//! * `kafka`: [`kafka::KafkaConsumer`]: a consumer group whose offsets are
//!   committed only up to the lowest record not yet decided, in-process
//!   retries, retry and dead-letter topics, rebalances with a deadline;
//! * `sqs` (needs rustc 1.94.1, as the AWS SDK does): [`sqs::SqsConsumer`]:
//!   batched long-poll receives, visibility extended while handlers run,
//!   `DeleteMessageBatch`, nacks as visibility changes, dead letters (with
//!   idem's reason) to the queue's dead-letter queue, FIFO queues in order
//!   per message group.
//!
//! The other direction, for a transactional outbox: [`outbox`] has a
//! [`Sink`](outbox::Sink) per broker (`RedisStreamsSink`, `NatsSink`,
//! `RabbitSink`, `KafkaSink`, `SqsSink`, each behind its broker's feature) that puts
//! each message's id where the adapter above reads it, so re-sends replay.
//!
//! ```
//! use idem_consumer::{Consumer, Decision, Message};
//! use idem_core::{Idempotency, MemoryStore};
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "orders.ship");
//! let ship = |m: Message| async move {
//!     Ok::<_, std::io::Error>(format!("shipped {}", m.id().unwrap_or("?"))) // the side effect
//! };
//! let m = Message::new(r#"{"order":1}"#).with_id("order-1");
//! assert_eq!(consumer.handle(&m, &ship).await.decision, Decision::Ack);
//! // The broker redelivers after a crash before the ack: replayed, acked, not shipped twice.
//! let again = consumer.handle(&m.with_delivery_count(2), &ship).await;
//! assert_eq!(again.decision, Decision::Ack);
//! assert_eq!(again.outcome, Some(idem_core::Outcome::Replayed));
//! # });
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![allow(
    clippy::indexing_slicing,
    reason = "its indexing predates the workspace-wide deny and is not audited yet"
)]

mod adapter;
mod batch;
mod consumer;
mod decision;
mod error;
mod heartbeat;
mod message;
#[cfg(feature = "otel")]
mod otel;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
pub mod outbox;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub mod sqs;

pub use adapter::{Adapter, PollReport, Recovery};
pub use consumer::{Consumer, DEFAULT_MAX_DELIVERIES, Handled};
pub use decision::{
    AllRetryable, ByTrait, Classify, ClassifyError, DeadLetterReason, Decision, ErrorClass,
    dead_letter_field,
};
pub use error::{BrokerSource, ConsumerError};
pub use heartbeat::with_heartbeat;
pub use idem_core::{DeriveError, KeyDeriver};
pub use message::{KeySource, Message};
