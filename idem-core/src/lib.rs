//! # idem-core
//!
//! The runtime of [idem](https://docs.rs/idem): run a side-effecting async
//! operation exactly once per idempotency key, across tasks, processes and
//! machines on a shared store (Redis/Valkey in `idem-redis`, PostgreSQL in
//! `idem-postgres`), or within one process on [`MemoryStore`].
//!
//! ```
//! use idem_core::{Error, Idempotency, MemoryStore, Outcome};
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let idem = Idempotency::builder(MemoryStore::new()).namespace("payments").build();
//!
//! async fn charge(amount: u64) -> Result<String, Error> { Ok(format!("receipt for {amount}")) }
//!
//! // First delivery runs the body; a redelivery gets the stored answer.
//! let (r1, o1) = idem.call("charge", "order-7").run_outcome(|| charge(500)).await?;
//! let (r2, o2) = idem.call("charge", "order-7").run_outcome(|| charge(500)).await?;
//! assert_eq!(r1, r2);
//! assert_eq!((o1, o2), (Outcome::Executed, Outcome::Replayed));
//! # Ok::<(), Error>(()) }).unwrap();
//! ```
//!
//! A handler with several side effects runs them as durable steps
//! ([`Call::run_steps`], [`Steps`]): after a crash, the call that takes the
//! key over replays the finished steps and runs only the rest.
//!
//! [`KeyDeriver`] derives a key from a JSON payload that carries no id of
//! its own (canonical JSON minus volatile fields, SHA-256). idem-consumer's
//! `KeySource::Payload` is its one user inside idem, yet it lives here
//! rather than in idem-consumer: it depends on no broker nor transport (an
//! HTTP handler keys a request body with it as well), and the facade offers
//! it as `idem::KeyDeriver` in every build, the `consumer` feature on or
//! off, which only a crate the facade always depends on can give.
//!
//! The limits a call's durations must keep ([`MIN_DURATION`], [`MAX_TTL`],
//! [`MAX_LEASE`]; other values are [`Error::InvalidConfig`]) are defined in
//! `idem-key`, as [`MAX_KEY_LEN`] is, and re-exported here where they are
//! enforced: the `#[idempotent]` macro checks literal durations against the
//! same definitions at compile time, and a proc-macro crate depending on
//! the runtime would compile it (Tokio and all) for the host.
//!
//! See [`Call`] for the per-call options, [`IdempotencyBuilder`] for the
//! defaults, and [`store::Store`] for the state machine every store
//! implements.
//!
//! # Glossary
//!
//! One word per idea, in the API and its documentation:
//!
//! - **record**: what a store keeps under one key: pending (claimed by an
//!   owner token) or completed (holding the stored result), until its TTL.
//! - **lease**: how long a claim holds the key without renewal; once it runs
//!   out, the next claim takes the key over (`Outcome::Recovered`).
//! - **claim**: take a key for an owner token, writing a pending record,
//!   or learn what holds it ([`store::Store::claim`], [`store::Claim`]).
//! - **extend**: move the owner's lease deadline on while its body runs
//!   ([`store::Store::extend`]).
//! - **complete**: replace the owner's pending record by the completed one
//!   holding the body's result ([`store::Store::complete`],
//!   [`store::Complete`]).
//! - **release**: delete the owner's pending record, so that the next call
//!   runs the body ([`store::Store::release`]).
//! - **finish**: a complete or a release, as one item of a batch that ends
//!   several claims in one round trip ([`store::Finish`],
//!   [`store::Store::finish_batch`], [`Batch::finish_with`]).
//! - **capability**: something a store can do besides that state machine
//!   (durable steps, operator calls, notifications, durability
//!   confirmation, an outbox), offered through [`store::Store::capabilities`].
#![cfg_attr(docsrs, feature(doc_cfg))]
#![allow(
    clippy::indexing_slicing,
    reason = "its indexing predates the workspace-wide deny and is not audited yet"
)]

mod cache;
mod call;
mod codec;
mod derive;
mod durability;
mod error;
mod fingerprint;
mod hook;
mod idempotency;
mod key;
mod lease;
#[cfg(feature = "metrics")]
mod metrics;
mod operate;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod otel;
pub mod outbox;
mod outcome;
mod private;
mod settings;
pub mod store;
mod token;
mod version;

/// The attribute that implements a trait with `async fn`s, such as
/// [`outbox::Sink`]: re-exported from the `async-trait` crate so that a
/// sink of your own needs no dependency of its own.
///
/// ```
/// use idem_core::outbox::{OutboxMessage, Sink, SinkError};
///
/// /// Confirms every message without publishing it anywhere.
/// struct Discard;
///
/// #[idem_core::async_trait]
/// impl Sink for Discard {
///     async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
///         batch.iter().map(|_| Ok(())).collect()
///     }
///     fn describe(&self) -> String {
///         "discard".into()
///     }
/// }
/// ```
pub use async_trait::async_trait;
pub use call::{
    Batch, Call, CallGroup, FinishRoundTrip, MAX_STEP_NAME, StepStart, Steps, finish_round_trip,
};
pub use derive::{DeriveError, KeyDeriver};
pub use durability::{Durability, MAX_DURABILITY_TIMEOUT};
pub use error::{BoxError, Error, KeyError, KeyPart};
pub use fingerprint::Fingerprint;
pub use hook::{CallOutcome, OutcomeEvent};
pub use idempotency::{Idempotency, IdempotencyBuilder};
pub use key::{MAX_KEY_LEN, validate_key_part};
pub use lease::{Lease, lease};
pub use operate::{Forget, Scan, ScannedKey};
pub use outcome::Outcome;
pub use settings::{FailMode, MAX_LEASE, MAX_TTL, MIN_DURATION};
pub use store::{KeyState, MemoryStore, RecordInfo};
pub use version::{VersionRule, Versioned};

/// Support for the code `#[idempotent]` generates. Not a public API: it may
/// change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::private::*;
}
