//! `step_in_tx`: a durable step (`Call::run_steps`) whose effects are
//! database writes, recorded in the **same transaction** as those writes.
//! The step's rows and its recorded value commit together or not at all, so
//! even a crash inside the step leaves either both (the next holder replays
//! the step) or neither (the next holder runs it once more, on a clean
//! database): exactly once for the step's own writes.

use crate::store::PgStore;
use idem_core::{Error, StepStart, Steps};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;
use std::sync::Arc;

/// Runs a step of a `run_steps` body in a transaction of its own, with its
/// recorded value. Import with `use idem::postgres::*`.
///
/// ```no_run
/// use idem_core::{Error, Idempotency};
/// use idem_postgres::{PgStore, StepInTx, sqlx};
/// # async fn demo(store: PgStore, idem: Idempotency) -> Result<(), Error> {
/// let db = |e: sqlx::Error| Error::unavailable("debit", e.to_string());
/// idem.call("refunds", "r-9").run_steps(async |s| {
///     // Recorded in the transaction that debits: after a crash it never runs twice.
///     s.step_in_tx(&store, "debit", async |tx| {
///         sqlx::query("UPDATE accounts SET balance = balance - 500 WHERE id = 7")
///             .execute(&mut *tx).await.map(drop).map_err(db)
///     }).await?;
///     // An effect outside the database: an ordinary step.
///     s.step("notify", async || Ok::<_, Error>(())).await
/// }).await?;
/// # Ok(()) }
/// ```
pub trait StepInTx {
    /// Like [`Steps::step`], for a step whose effects are writes to the
    /// database `store` keeps its records in: `body` gets a transaction
    /// (opened on the store's pool), and the step's `Ok` value is recorded
    /// in that same transaction (an owner-token compare-and-set on the
    /// key's row) before it commits. `Err` from the body rolls its writes
    /// back and records nothing. A call that lost its lease is refused at
    /// the compare-and-set: the transaction rolls back and the step fails
    /// with [`Error::StepLeaseLost`], nothing of it committed.
    ///
    /// ```no_run
    /// use idem_postgres::{PgStore, StepInTx, sqlx};
    /// use idem_core::{Error, Idempotency};
    /// # async fn demo(store: PgStore) -> Result<(), Error> {
    /// let idem = Idempotency::builder(store.clone()).build();
    /// let id: i64 = idem.call("orders.place", "o-1").run_steps(async |s| {
    ///     let id = s.step_in_tx(&store, "insert", async |tx| {
    ///         sqlx::query_scalar::<_, i64>("INSERT INTO orders (customer) VALUES ('ada') RETURNING id")
    ///             .fetch_one(&mut *tx).await
    ///             .map_err(|e| Error::unavailable("claim", e.to_string()))
    ///     }).await?;
    ///     Ok::<_, Error>(id)
    /// }).await?;
    /// # Ok(()) }
    /// ```
    #[allow(async_fn_in_trait)]
    async fn step_in_tx<V, E, F>(&self, store: &PgStore, name: &str, body: F) -> Result<V, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<V, E>,
        V: Serialize + DeserializeOwned,
        E: From<Error>;
}

impl StepInTx for Steps {
    async fn step_in_tx<V, E, F>(&self, store: &PgStore, name: &str, body: F) -> Result<V, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<V, E>,
        V: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let (key, token, limit) = match self.begin_step(name)? {
            StepStart::Recorded(bytes) => {
                return serde_json::from_slice(&bytes).map_err(|e| {
                    E::from(
                        Error::codec(format!(
                            "the recorded value of step `{name}` does not deserialize into the \
                             type asked for (did the step's type change?); forget the key to start over"
                        ))
                        .with_source(e),
                    )
                });
            }
            StepStart::Run {
                key,
                token,
                max_value_size,
            } => (Some(key), token, max_value_size),
            // Unprotected (FailMode::Open): run, record nothing.
            _ => (None, idem_core::store::Token::from_u128(0), usize::MAX),
        };
        let pool = &store.inner.pool;
        let mut txn = pool
            .begin()
            .await
            .map_err(|e| E::from(store.fail("step")(e)))?;
        // An `Err` drops `txn`: the step's writes roll back.
        let value = body(&mut txn).await?;
        if let Some(key) = &key {
            let bytes = serde_json::to_vec(&value).map_err(|e| {
                E::from(
                    Error::codec(format!(
                        "the value of step `{name}` cannot be serialized, so it was not recorded"
                    ))
                    .with_source(e),
                )
            })?;
            if bytes.len() > limit {
                return Err(E::from(Error::TooLarge {
                    size: bytes.len(),
                    limit,
                }));
            }
            let text = String::from_utf8(bytes)
                .map_err(|_| E::from(Error::codec("a step value that is not UTF-8 JSON")))?;
            let done = sqlx::query(AssertSqlSafe(Arc::clone(&store.inner.sql.save_step)))
                .bind(key.as_str())
                .bind(&token.as_raw()[..])
                .bind(name)
                .bind(text)
                .execute(&mut *txn)
                .await
                .map_err(|e| E::from(store.fail("step")(e)))?
                .rows_affected();
            if done == 0 {
                if let Err(e) = txn.rollback().await {
                    tracing::debug!(error = %e, "rollback failed; the server aborts the transaction with the connection");
                }
                tracing::warn!(
                    step = name,
                    "step_in_tx: this call no longer holds the key: rolled back, nothing of the step committed"
                );
                return Err(E::from(Error::StepLeaseLost {
                    name: name.to_owned(),
                }));
            }
        }
        txn.commit()
            .await
            .map_err(|e| E::from(store.fail("commit")(e)))?;
        if key.is_some() {
            self.step_recorded(name);
        }
        Ok(value)
    }
}
