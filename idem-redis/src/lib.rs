//! # idem-redis
//!
//! The Redis store for [idem](https://docs.rs/idem) (Redis 7.0 or newer,
//! Valkey; standalone or Cluster): [`RedisStore`] keeps one compact string
//! per key, changed only by the Lua scripts of the workspace's `lua/`
//! (their format: `lua/README.md`), and wakes this process's waiters and
//! local caches through sharded pub/sub. Its outbox ([`outbox`]) keeps the
//! messages a body staged in Redis Streams, written by the same script as
//! the call's result, and [`outbox::RedisRelay`] publishes them.
//!
//! ```no_run
//! use idem_core::{Error, Idempotency};
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Error> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?; // or connect_cluster(&[urls…])
//! let idem = Idempotency::builder(store).namespace("payments").build();
//! let receipt: String = idem
//!     .call("payments.charge", "order-7")
//!     .run(|| async { Ok::<_, Error>("rcpt-7".to_owned()) })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The facade crate `idem` re-exports this crate as `idem::redis`, and its
//! items at the paths applications already use (`idem::RedisStore`,
//! `idem::outbox::RedisRelay`). The store contract it implements is
//! [`idem_core::store::Store`].
#![allow(
    clippy::indexing_slicing,
    reason = "its indexing predates the workspace-wide deny and is not audited yet"
)]

pub mod outbox;
mod store;

pub use store::{RedisStore, RedisStoreConfig};

/// The redis-rs this crate is built on, so that the `ConnectionManager` or
/// cluster connection given to [`RedisStore::from_manager`] and
/// [`RedisStore::from_cluster`] are the same types (`idem::redis::redis`).
pub use redis;
