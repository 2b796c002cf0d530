//! The transactional outbox: messages for the next system, written in the
//! same transaction as a call's stored result, and a [`PgRelay`] that
//! publishes them to a broker at least once, in order per key, each with a
//! deterministic id that the consumer on the other side de-duplicates on.
//!
//! | guarantee | how |
//! | --- | --- |
//! | the message commits with the stored result, or neither does | [`publish`] inserts into `<table>_outbox` in the `run_in_tx` body's transaction |
//! | published at least once, deleted only once the broker confirmed it | the relay deletes a row in the transaction that locked it, after the sink's confirmation |
//! | in order per key | a relay owns a key from its oldest row (`FOR UPDATE SKIP LOCKED`) and sends a key's next message only after the previous one was confirmed |
//! | any number of relays | they skip each other's keys; new rows wake them (`LISTEN`/`NOTIFY`), a slow poll is the insurance |
//! | re-sends are harmless downstream | the id ([`message_id`](idem_core::outbox::message_id)) travels in the broker's id field; an idem consumer runs its effect once per id |
//! | a message the broker refuses is never lost nor blocks other keys | it is parked with its reason (its own key waits behind it, to keep the order); [`Outbox::parked`], [`Outbox::retry`], [`Outbox::drop_parked`], or `idem outbox list|retry|drop` |
//!
//! ```no_run
//! use idem_core::outbox::{OutboxMessage, Sink, SinkError};
//! use idem_postgres::{PgStore, outbox::PgRelay};
//!
//! # async fn demo(store: PgStore, sink: impl Sink + 'static) -> Result<(), idem_core::Error> {
//! store.migrate().await?; // creates idem_keys_outbox too
//! let relay = PgRelay::new(&store, sink);
//! let (_stop, stopped) = tokio::sync::oneshot::channel::<()>(); // send on `_stop` at shutdown
//! let report = relay.run(async { let _ = stopped.await; }).await;
//! tracing::info!(sent = report.sent, parked = report.parked, "relay stopped");
//! # Ok(()) }
//! ```

mod headers;
mod publish;
mod relay;
pub(crate) mod table;

pub use idem_core::outbox::{Backlog, Parked, RelayReport};
pub use publish::publish;
pub(crate) use publish::{Publishing, scope};
pub use relay::{PgRelay, PgSource, Relay};

use crate::config::PgStoreConfig;
use crate::errors;
use crate::store::PgStore;
use idem_core::Error;
use idem_core::outbox::check_field;
use serde::Serialize;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{AssertSqlSafe, Row};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use table::OutboxSql;

/// The outbox table of one records table (`<table>_outbox`, created by
/// [`PgStore::migrate`]) on one pool: publishing with an id of your own,
/// the backlog, and the operator's view of parked messages.
///
/// ```no_run
/// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
/// let outbox = store.outbox();
/// let backlog = outbox.backlog().await?;
/// for m in outbox.parked(100).await? {
///     eprintln!("{} to {}: {}", m.id, m.topic, m.reason.as_deref().unwrap_or("?"));
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Outbox {
    pub(crate) pool: PgPool,
    pub(crate) sql: Arc<OutboxSql>,
}

impl From<&PgStore> for Outbox {
    fn from(store: &PgStore) -> Outbox {
        store.outbox()
    }
}

/// The outbox of the default table (`idem_keys_outbox`) on `pool`, so that
/// `PgRelay::new(pool, sink)` works without a store.
impl From<PgPool> for Outbox {
    fn from(pool: PgPool) -> Outbox {
        Outbox {
            pool,
            sql: Arc::new(OutboxSql::new(&crate::config::TableName::default_table())),
        }
    }
}

impl PgStore {
    /// The outbox beside this store's table, on its pool.
    ///
    /// ```no_run
    /// # fn demo(store: idem_postgres::PgStore) {
    /// let outbox = store.outbox();
    /// # }
    /// ```
    pub fn outbox(&self) -> Outbox {
        Outbox {
            pool: self.inner.pool.clone(),
            sql: Arc::clone(&self.inner.outbox),
        }
    }
}

impl Outbox {
    /// The outbox of `config`'s table on `pool` (for a relay or an operator
    /// tool that has no store).
    ///
    /// ```no_run
    /// use idem_postgres::{PgStoreConfig, outbox::Outbox};
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), idem_core::Error> {
    /// let outbox = Outbox::new(pool, PgStoreConfig::default())?;
    /// # Ok(()) }
    /// ```
    pub fn new(pool: PgPool, config: PgStoreConfig) -> Result<Outbox, Error> {
        Ok(Outbox {
            pool,
            sql: Arc::new(OutboxSql::new(&config.table_ident()?)),
        })
    }

    /// Writes a message with an id of your own in `tx` (any transaction on
    /// this database): for code outside `run_in_tx`. The same id twice keeps
    /// one message. Topic, key and id are checked as by
    /// [`publish`]; with the `otel` feature, the message carries the trace
    /// of the current span as [`publish`]'s does.
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// outbox.publish_with_id(&mut tx, "invoices.sent", "inv-7", "invoice-7-sent", &7).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn publish_with_id<V: Serialize + ?Sized>(
        &self,
        tx: &mut PgConnection,
        topic: &str,
        key: &str,
        id: &str,
        value: &V,
    ) -> Result<(), Error> {
        check_field("topic", topic)?;
        check_field("key", key)?;
        check_field("id", id)?;
        publish::insert(tx, &self.sql, id, topic, key, value).await
    }

    /// How many messages wait, how many are parked, and how old the oldest
    /// waiting one is (what a dashboard shows; a growing age means the
    /// relay is down or the broker refuses).
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox) -> Result<(), idem_core::Error> {
    /// let b = outbox.backlog().await?;
    /// assert!(b.parked == 0, "{} parked messages: see `idem outbox list`", b.parked);
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self) -> Result<Backlog, Error> {
        let row = sqlx::query(AssertSqlSafe(self.sql.backlog.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(self.fail("outbox backlog"))?;
        let count = |name: &str| -> Result<u64, Error> {
            let n: i64 = row.try_get(name).map_err(self.fail("outbox backlog"))?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        let oldest: Option<i64> = row
            .try_get("oldest_ms")
            .map_err(self.fail("outbox backlog"))?;
        Ok(Backlog {
            pending: count("pending")?,
            parked: count("parked")?,
            oldest: oldest.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        })
    }

    /// Up to `limit` parked messages, oldest first.
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox) -> Result<(), idem_core::Error> {
    /// for m in outbox.parked(20).await? {
    ///     eprintln!("{} ({} bytes to {}): {:?}", m.id, m.size, m.topic, m.reason);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked(&self, limit: usize) -> Result<Vec<Parked>, Error> {
        let limit = i64::try_from(limit.clamp(1, 100_000)).unwrap_or(100_000);
        let rows = sqlx::query(AssertSqlSafe(self.sql.parked.as_str()))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(self.fail("outbox list"))?;
        rows.iter().map(|r| self.parked_row(r)).collect()
    }

    /// Sends a parked message again (after the cause was fixed: the topic
    /// created, the limit raised). `false` when no parked message has this
    /// id. The relay picks it up at its next pass.
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox) -> Result<(), idem_core::Error> {
    /// assert!(outbox.retry("3f2a…").await?);
    /// # Ok(()) }
    /// ```
    pub async fn retry(&self, id: &str) -> Result<bool, Error> {
        let done = sqlx::query(AssertSqlSafe(self.sql.retry.as_str()))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(self.fail("outbox retry"))?;
        Ok(done.rows_affected() > 0)
    }

    /// Sends every parked message again; answers how many.
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox) -> Result<(), idem_core::Error> {
    /// let n = outbox.retry_all().await?;
    /// # Ok(()) }
    /// ```
    pub async fn retry_all(&self) -> Result<u64, Error> {
        let done = sqlx::query(AssertSqlSafe(self.sql.retry_all.as_str()))
            .execute(&self.pool)
            .await
            .map_err(self.fail("outbox retry"))?;
        Ok(done.rows_affected())
    }

    /// Deletes a parked message for good, unblocking its key; answers what
    /// it was, or `None` when no parked message has this id (a message that
    /// is not parked may be on its way, and is never dropped).
    ///
    /// ```no_run
    /// # async fn demo(outbox: idem_postgres::outbox::Outbox) -> Result<(), idem_core::Error> {
    /// if let Some(m) = outbox.drop_parked("3f2a…").await? {
    ///     eprintln!("dropped {} to {}", m.id, m.topic);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn drop_parked(&self, id: &str) -> Result<Option<Parked>, Error> {
        let row = sqlx::query(AssertSqlSafe(self.sql.drop.as_str()))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(self.fail("outbox drop"))?;
        row.map(|r| self.parked_row(&r)).transpose()
    }

    fn parked_row(&self, r: &sqlx::postgres::PgRow) -> Result<Parked, Error> {
        let fail = self.fail("outbox list");
        let size: i64 = r.try_get("size").map_err(&fail)?;
        let attempts: i32 = r.try_get("attempts").map_err(&fail)?;
        Ok(Parked {
            id: r.try_get("id").map_err(&fail)?,
            topic: r.try_get("topic").map_err(&fail)?,
            key: r.try_get("msg_key").map_err(&fail)?,
            size: u64::try_from(size).unwrap_or(0),
            attempts: u32::try_from(attempts).unwrap_or(0),
            reason: r.try_get("last_error").map_err(&fail)?,
            created_at: epoch_ms(r.try_get("created_ms").map_err(&fail)?),
            parked_at: r
                .try_get::<Option<i64>, _>("parked_ms")
                .map_err(&fail)?
                .map(epoch_ms),
        })
    }

    pub(crate) fn fail(&self, op: &'static str) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| errors::map(op, &self.sql.table, e)
    }
}

/// A database timestamp read as milliseconds since the epoch (no date
/// crate needed for two fields an operator reads).
fn epoch_ms(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
