//! # idem-postgres
//!
//! A PostgreSQL store for [idem](https://docs.rs/idem): the same
//! exactly-once state machine as its Redis store, in one table, on the
//! database's clock — and [`RunInTx::run_in_tx`], which commits a body's own
//! writes and its stored result **in one transaction**, so there is never
//! a moment where the work is done but the key says "in flight", or the key
//! says "done" but the rows are missing.
//!
//! ```no_run
//! use idem_core::Idempotency;
//! use idem_postgres::{PgStore, RunInTx};
//!
//! /// The application's error: idem's and the database's, each kept whole
//! /// (match on it, or walk `source()`), no dressing up as one another.
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)]
//!     Idem(#[from] idem_core::Error),
//!     #[error("database: {0}")]
//!     Db(#[from] sqlx::Error),
//! }
//!
//! # async fn demo() -> Result<(), AppError> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! let store = PgStore::from_pool(pool.clone());
//! store.migrate().await?; // creates `idem_keys` and its functions if missing (or apply schema.sql yourself)
//! let idem = Idempotency::builder(store).namespace("orders").build();
//!
//! // Plain calls work as on Redis:
//! let n: u32 = idem.call("orders.count", "req-1").run(|| async { Ok::<_, AppError>(3) }).await?;
//!
//! // The row and the stored result commit together:
//! let id: i64 = idem
//!     .call("orders.create", "req-2")
//!     .run_in_tx(&pool, async |tx| {
//!         let (id,): (i64,) = sqlx::query_as("INSERT INTO orders (amount) VALUES (500) RETURNING id")
//!             .fetch_one(&mut *tx)
//!             .await?;
//!         Ok::<_, AppError>(id)
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Tables: [`PgStoreConfig`]; schema: `schema.sql` or [`PgStore::migrate`];
//! expired rows: [`PgStore::reap`] and [`PgStore::spawn_reaper`], or whole
//! partitions with tables partitioned by time
//! ([`PgStoreConfig::partitioned`], [`PgStore::maintain`]).

mod batch;
mod claim_path;
mod config;
mod errors;
mod operate;
pub mod outbox;
mod partitions;
mod reaper;
mod row;
mod schema;
mod sql;
mod steps;
mod store;
mod store_impl;
mod time;
mod tx;
mod write;

pub use config::{DEFAULT_TABLE, PgStoreConfig};
pub use partitions::Maintenance;
pub use reaper::Reaper;
pub use steps::StepInTx;
pub use store::PgStore;
pub use tx::RunInTx;

/// The sqlx this crate is built on, so that the `PgPool` and
/// `PgConnection` you pass are the same types (`idem::postgres::sqlx`).
pub use sqlx;

/// The schema of the default table (`idem_keys`), as shipped in `schema.sql`.
///
/// ```
/// assert!(idem_postgres::SCHEMA_SQL.contains("CREATE TABLE IF NOT EXISTS \"idem_keys\""));
/// ```
pub const SCHEMA_SQL: &str = include_str!("../schema.sql");
