//! # idem-core
//!
//! The runtime of [idem](https://docs.rs/idem): run a side-effecting async
//! operation exactly once per idempotency key, across tasks, processes and
//! machines, with Redis (or, in one process, memory) as the arbiter.
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
//! See [`Call`] for the per-call options, [`IdempotencyBuilder`] for the
//! defaults, and [`store::Store`] for the state machine both
//! stores implement.

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
pub mod outbox;
mod outcome;
mod private;
mod settings;
pub mod store;
mod token;

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
pub use settings::FailMode;
pub use store::{KeyState, MemoryStore, RecordInfo};

/// Support for the code `#[idempotent]` generates. Not a public API: it may
/// change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::private::*;
}
