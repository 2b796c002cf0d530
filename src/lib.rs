//! # idem
//!
//! Run side-effecting async operations exactly once per idempotency key:
//! across tasks, processes and machines on Redis/Valkey (`RedisStore`,
//! feature `redis`) or PostgreSQL (`idem::postgres::PgStore`, feature
//! `postgres`), or within one process on `MemoryStore`.
//!
//! ```
//! use idem::{idempotent, Idempotency, MemoryStore};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, PartialEq, Serialize, Deserialize)]
//! struct Receipt { id: String, amount: u64 }
//!
//! #[derive(Debug)]
//! enum PaymentError { Idem(idem::Error) }
//! impl From<idem::Error> for PaymentError {
//!     fn from(e: idem::Error) -> Self { PaymentError::Idem(e) }
//! }
//!
//! #[idempotent(key = order_id, ttl = "24h")]
//! async fn charge(order_id: &str, amount: u64) -> Result<Receipt, PaymentError> {
//!     // … call the payment provider: runs once per order_id …
//!     Ok(Receipt { id: format!("rcpt-{order_id}"), amount })
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! Idempotency::builder(MemoryStore::new()).namespace("payments").build().install()?;
//! let first = charge("order-1", 500).await.unwrap();
//! let retry = charge("order-1", 500).await.unwrap(); // replayed, body not run
//! assert_eq!(first, retry);
//! # Ok::<(), idem::Error>(()) }).unwrap();
//! ```
//!
//! ## Which errors to retry
//!
//! [`Error::is_retryable`] says whether calling again with the same key can
//! succeed (it replays, waits, or runs); its documentation lists those
//! errors and what the retry does for each. Every other error fails the
//! same way again. A worker loop of your own retries the first kind and
//! gives up on the rest (docs/semantics.md lists every variant with its
//! fields). With a [`Durability`], a body's value may also come back not
//! final (stored on the primary only, or not stored):
//! [`Outcome`] says which, and the builder's `require_final` (on by
//! default with a durability other than `Async`) makes `run` answer those
//! with an error this loop retries; docs/semantics.md, "Durability".
//!
//! ```
//! use idem::{Error, Idempotency, MemoryStore};
//! use std::time::Duration;
//!
//! async fn run_job(idem: &Idempotency, job: &str) -> Result<u64, Error> {
//!     let mut backoff = Duration::from_millis(50);
//!     let mut tries = 0;
//!     loop {
//!         tries += 1;
//!         let r: Result<u64, Error> = idem.call("jobs.run", job).run(|| async { Ok(42) }).await;
//!         match r {
//!             // Another worker holds the key: its lease says when to look again.
//!             Err(Error::InProgress { retry_after }) if tries < 5 => tokio::time::sleep(retry_after).await,
//!             // The store is down, a lease or a transaction was lost, the copies
//!             // did not confirm: back off, same key.
//!             Err(e) if e.is_retryable() && tries < 5 => {
//!                 tokio::time::sleep(backoff).await;
//!                 backoff *= 2;
//!             }
//!             // Done, or an error that would fail again: dead-letter the job.
//!             other => return other,
//!         }
//!     }
//! }
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let idem = Idempotency::builder(MemoryStore::new()).build();
//! assert_eq!(run_job(&idem, "job-1").await?, 42);
//! assert!(!Error::FingerprintMismatch.is_retryable());
//! # Ok::<(), Error>(()) }).unwrap();
//! ```
//!
//! The runtime lives in [`idem_core`] (re-exported here); the attribute in
//! [`idem_macros`]. The Redis store is [`idem_redis`] (feature `redis`, on
//! by default; re-exported as [`redis`], and its store as [`RedisStore`]).
//! With feature `client`, [`client`] is a retrying HTTP client that keeps
//! one key per operation; with feature `http`, [`http`] is a tower layer
//! giving axum services `Idempotency-Key` semantics (and with feature
//! `lambda`, [`lambda`] runs SQS batches on AWS Lambda once per record and
//! puts that layer on API Gateway); with feature `grpc`,
//! [`grpc`] runs tonic services' unary RPCs once per key and replays their
//! answers, and its `client` resends one key per operation.
#![cfg_attr(docsrs, feature(doc_cfg))]

/// `#[idem::async_trait]`: implements a trait with `async fn`s, such as
/// [`outbox::Sink`], with no `async-trait` dependency of your own.
pub use idem_core::async_trait;
pub use idem_core::*;
pub use idem_macros::idempotent;

/// The Redis store (feature `redis`, on by default): [`RedisStore`],
/// standalone or Cluster, and its outbox; see [`idem_redis`].
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idem_redis as redis;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idem_redis::{RedisStore, RedisStoreConfig};

pub mod store {
    //! For store authors: the [`Store`] contract every backend implements,
    //! the types of its requests and replies, and the pieces stores share
    //! (how leases and TTLs are counted, the [`Hub`] that wakes waiters);
    //! see [`idem_core::store`]. An application needs none of it: it builds
    //! a store and hands it to [`Idempotency::builder`](crate::Idempotency::builder).
    pub use idem_core::store::*;
}

/// The typed, retrying HTTP client (feature `client`); see [`idem_client`].
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub use idem_client as client;

/// The `Idempotency-Key` tower layer (feature `http`); see [`idem_http`].
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use idem_http as http;

/// Exactly-once unary RPCs for tonic servers, and the retrying client side
/// (feature `grpc`); see [`idem_grpc`].
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub use idem_grpc as grpc;

/// Exactly-once message consumers: the broker-agnostic core and the Redis
/// Streams, NATS JetStream, RabbitMQ and Kafka adapters (feature `consumer`,
/// plus `redis-streams`, `nats`, `rabbitmq`, `kafka`); see [`idem_consumer`].
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub use idem_consumer as consumer;

/// AWS Lambda (feature `lambda`): SQS batch handlers that run each record
/// once per key and report partial batch failures, and the
/// `Idempotency-Key` layer on API Gateway; see [`idem_lambda`].
#[cfg(feature = "lambda")]
#[cfg_attr(docsrs, doc(cfg(feature = "lambda")))]
pub use idem_lambda as lambda;

/// The PostgreSQL store and `run_in_tx` (feature `postgres`); see [`idem_postgres`].
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idem_postgres as postgres;

/// The DynamoDB store, `DynamoStore` (feature `dynamodb`); see [`idem_dynamodb`].
#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub use idem_dynamodb as dynamodb;

/// OpenTelemetry (feature `otel`): the W3C trace context a call continues
/// and an outbox message carries, and the spans of the messaging
/// conventions; see [`idem_core::otel`]. `tracing-opentelemetry`'s layer
/// turns idem's `tracing` spans into OpenTelemetry spans.
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub use idem_core::otel;

/// The transactional outbox: messages for the next system committed with a
/// call's result, and a relay that publishes them at least once, in order
/// per key, with ids the consumer on the other side de-duplicates on.
///
/// - always: the contract ([`Sink`](outbox::Sink),
///   [`OutboxMessage`](outbox::OutboxMessage), [`message_id`](outbox::message_id)),
///   [`stage`](outbox::stage) (a message stored with the result by a
///   store that has an outbox), and the one relay,
///   [`OutboxRelay`](outbox::OutboxRelay), over any
///   [`RelaySource`](outbox::RelaySource);
/// - feature `redis` (default): `RedisRelay` (the relay over a
///   `RedisSource`), `RedisOutbox`;
/// - feature `postgres`: `publish` (in a `run_in_tx` body), `Outbox`,
///   `PgRelay` (the relay over a `PgSource`; `Relay` is its earlier name);
/// - features `redis-streams`, `nats`, `rabbitmq`, `kafka`: the brokers'
///   sinks.
///
/// The guide is `docs/outbox.md`.
pub mod outbox {
    #[cfg(feature = "consumer")]
    #[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
    pub use idem_consumer::outbox::*;
    pub use idem_core::outbox::*;
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub use idem_postgres::outbox::*;
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub use idem_redis::outbox::*;
}
