//! Deleting expired records: `PgStore::reap` and an optional background
//! reaper (which also maintains a partitioned store's partitions).
//!
//! Expired rows are already invisible (every statement treats a row past
//! `expires_at` as absent), so reaping only reclaims space; it can run
//! late, from a cron, or from every instance at once.

use crate::errors::{map, map_failures};
use crate::store::PgStore;
use idem_core::Error;
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::time::Duration;

impl PgStore {
    /// Deletes up to `limit` expired records, then up to `limit` expired
    /// failure counts (`<table>_failures`), and returns how many rows it
    /// deleted in all. Rows locked by a concurrent claim or reaper are skipped
    /// (`FOR UPDATE SKIP LOCKED`), so reapers never wait on each other.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
    /// while store.reap(1000).await? == 1000 {} // everything expired, in batches
    /// # Ok(()) }
    /// ```
    pub async fn reap(&self, limit: u32) -> Result<u64, Error> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.reap)))
            .bind(i64::from(limit))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| map("reap", &self.table_str(), e))?;
        let sql = &self.inner.sql;
        let counts = sqlx::query(AssertSqlSafe(Arc::clone(&sql.reap_failures)))
            .bind(i64::from(limit))
            .execute(&self.inner.pool)
            .await
            .map_err(|e| map_failures("reap", &sql.failures_table, e))?;
        Ok(done.rows_affected() + counts.rows_affected())
    }

    /// Starts a Tokio task that reaps every `every`, in batches of `batch`
    /// until a batch comes back short. On a partitioned store each tick
    /// first runs [`maintain`](PgStore::maintain), and reaping deletes only
    /// from the default partition. Stops when the returned [`Reaper`]
    /// is dropped. Failures are logged and retried at the next tick.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) {
    /// let _reaper = store.spawn_reaper(std::time::Duration::from_secs(60), 1000);
    /// // … keep `_reaper` alive as long as the service runs
    /// # }
    /// ```
    pub fn spawn_reaper(&self, every: Duration, batch: u32) -> Reaper {
        let store = self.clone();
        let batch = batch.max(1);
        let every = every.max(Duration::from_millis(10));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = store.maintain().await {
                    tracing::warn!(error = %e, "maintaining the partitions of idempotency records failed; retrying at the next tick");
                }
                let mut total = 0u64;
                loop {
                    match store.reap(batch).await {
                        Ok(n) => {
                            total += n;
                            if n < u64::from(batch) {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "reaping expired idempotency records failed; retrying at the next tick");
                            break;
                        }
                    }
                }
                if total > 0 {
                    tracing::debug!(deleted = total, "reaped expired idempotency records");
                }
            }
        });
        Reaper { task }
    }
}

/// The background reaper of [`PgStore::spawn_reaper`]; dropping it stops it.
///
/// ```no_run
/// # async fn demo(store: idem_postgres::PgStore) {
/// let reaper = store.spawn_reaper(std::time::Duration::from_secs(60), 1000);
/// drop(reaper); // stopped
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the reaper stops when this handle is dropped"]
pub struct Reaper {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.task.abort();
    }
}
