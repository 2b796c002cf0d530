//! `run_in_tx`: the body's writes and its stored result commit together.
//!
//! The call runs through idem-core's ordinary `Call::run_outcome` (so
//! waiting, replay, the local cache, keep-alive, release on `Err` or panic
//! and `FailMode` behave as for every other call; a cancellation releases
//! too, through `Call::release_on_cancel`, as the dropped transaction rolls
//! back), with a task-local [`TxSlot`] that tells the `PgStore` serving
//! that call:
//!
//! 1. the claim (its own short autocommit statement) marks the row `in_tx`;
//!    it runs on a connection taken from the caller's pool (when that pool
//!    reaches the store's database as the store's pool does), which the
//!    slot keeps when the claim is won;
//! 2. the body gets a transaction opened on that same connection, so the
//!    claim's pool round trips (sqlx pings a connection when it is taken
//!    and when it is given back) are not paid twice;
//! 3. on `Ok`, idem-core's `complete` reaches `PgStore::complete`, which
//!    takes the open transaction from the slot, runs the owner-token
//!    compare-and-set in it and commits: record and rows together;
//! 4. if the CAS touches no row (the lease was lost) it rolls back and the
//!    call fails with `Error::LeaseLost`;
//! 5. a plain `complete` of an `in_tx` row (a re-send after a broken
//!    connection, or a completion idem-core finishes in a task of its own
//!    after the caller's future was dropped) never stores the result: the
//!    transaction is gone, so it releases the key unless it finds the
//!    record completed by the commit.
//!
//! The lease is renewed by idem-core on another pool connection, never
//! through the caller's transaction.

use crate::errors;
use crate::outbox::table::OutboxSql;
use crate::outbox::{self, Publishing};
use idem_core::{Call, Error, Outcome};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::pool::{MaybePoolConnection, PoolConnection};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Transaction};
use std::sync::{Arc, Mutex, MutexGuard};

tokio::task_local! {
    /// The `run_in_tx` call this task is running, if any. `None` inside the
    /// body, so that idem calls the body makes are ordinary calls.
    static SLOT: Option<Arc<TxSlot>>;
}

/// The slot of the `run_in_tx` call running in this task, if any.
pub(crate) fn current() -> Option<Arc<TxSlot>> {
    SLOT.try_with(Clone::clone).ok().flatten()
}

/// What one `run_in_tx` call shares with the `PgStore` serving it.
pub(crate) struct TxSlot {
    /// The caller's pool: the claim and the body's transaction use one of
    /// its connections (the CAS runs there anyway, so it reaches the table).
    pool: PgPool,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// A `PgStore` claimed for this call (so `run_in_tx` is not used over
    /// some other store, where the result could not join the transaction).
    claimed_by_pg: bool,
    token: Option<[u8; 16]>,
    /// The connection a won claim ran on, until the body opens its
    /// transaction on it. Not kept for any other answer: a waiting caller
    /// must not hold a connection while it sleeps.
    conn: Option<PoolConnection<Postgres>>,
    /// The body's transaction, between the body's `Ok` and the CAS.
    txn: Option<Transaction<'static, Postgres>>,
    committed: bool,
    /// Why the body's writes were not committed.
    failure: Option<Error>,
    /// What `outbox::publish` in the body derives its ids from and writes
    /// to: the claimed key and the claiming store's outbox.
    publishing: Option<Arc<Publishing>>,
}

impl TxSlot {
    fn new(pool: PgPool) -> TxSlot {
        TxSlot {
            pool,
            state: Mutex::default(),
        }
    }

    /// A connection for the claim: the one an earlier claim of this call
    /// kept, or a new one from the caller's pool. `None` when the caller's
    /// pool does not reach the store's database as the store's own pool
    /// does: then the claim stays on the store's pool, where every other
    /// call on this key looks.
    pub(crate) async fn claim_conn(
        &self,
        store_pool: &PgPool,
    ) -> Option<Result<PoolConnection<Postgres>, sqlx::Error>> {
        if let Some(conn) = self.lock().conn.take() {
            return Some(Ok(conn));
        }
        if !same_database(&self.pool, store_pool) {
            return None;
        }
        // Boxed: sqlx's acquire future holds a whole connection set-up
        // (several kB), which the claim's future would otherwise carry and
        // copy on every call, replays included.
        Some(Box::pin(self.pool.acquire()).await)
    }

    /// Keeps the connection a won claim ran on, for the body.
    pub(crate) fn keep_conn(&self, conn: PoolConnection<Postgres>) {
        self.lock().conn = Some(conn);
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        // Nothing panics while holding it; recover anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn note_claim(&self, token: [u8; 16], key: &str, outbox: &Arc<OutboxSql>) {
        let mut s = self.lock();
        s.claimed_by_pg = true;
        s.token = Some(token);
        if s.publishing.is_none() {
            s.publishing = Some(Arc::new(Publishing::new(
                key.to_owned(),
                Arc::clone(outbox),
            )));
        }
    }

    /// The open transaction, for the holder of `token` only.
    pub(crate) fn take_tx(&self, token: &[u8; 16]) -> Option<Transaction<'static, Postgres>> {
        let mut s = self.lock();
        if s.token.as_ref() == Some(token) {
            s.txn.take()
        } else {
            None
        }
    }

    pub(crate) fn committed(&self) {
        self.lock().committed = true;
    }

    pub(crate) fn failed(&self, e: Error) {
        self.lock().failure = Some(e);
    }

    pub(crate) fn failed_if_unset(&self, e: Error) {
        self.lock().failure.get_or_insert(e);
    }
}

/// Whether two pools open sessions on the same database as the same user
/// with the same options: one pool, or two built from the same address.
fn same_database(a: &PgPool, b: &PgPool) -> bool {
    let (a, b) = (a.connect_options(), b.connect_options());
    Arc::ptr_eq(&a, &b)
        || (a.get_host() == b.get_host()
            && a.get_port() == b.get_port()
            && a.get_socket() == b.get_socket()
            && a.get_username() == b.get_username()
            && a.get_database() == b.get_database()
            && a.get_options() == b.get_options())
}

/// `run_in_tx` and `run_in_tx_outcome` on idem's [`Call`]: the body's
/// writes and its stored result commit in one PostgreSQL transaction.
///
/// The `Idempotency` must be built over a [`PgStore`](crate::PgStore) whose
/// table is in the database `pool` connects to (typically
/// `PgStore::from_pool(pool.clone())`).
///
/// - The claim commits first, in its own short statement, so duplicates see
///   the key in flight (`Error::InProgress { retry_after }`) at once. When
///   `pool` is the store's pool (or connects to the same database, user and
///   options), it runs on the connection the body's transaction then opens
///   on: `run_in_tx` costs one round trip more than the body's own
///   transaction.
/// - The body gets `&mut PgConnection` inside a transaction idem opened on
///   `pool` (READ COMMITTED; it may `SET TRANSACTION ISOLATION LEVEL …` as
///   its first statement). It must not commit or roll back itself.
/// - `Ok`: the completed record is written in that transaction with an
///   owner-token compare-and-set, then it commits. A lease lost meanwhile
///   (the body outran it without being polled, or the row was taken over)
///   rolls everything back and answers `Error::LeaseLost`.
/// - `Err`, panic, cancellation: rolled back, then the key is released (a
///   cancelled `run_in_tx` releases at once, unlike a plain call, which
///   keeps its key for the lease: here the rollback undoes the body).
/// - A serialization failure or deadlock at the CAS or the commit
///   (SQLSTATE `40001`, `40P01`) answers `Error::Conflict`, retryable; the
///   key is released. Under REPEATABLE READ or SERIALIZABLE, a lease renewal
///   during a long body is such a conflict: keep those bodies under a third
///   of the lease, or raise the lease.
/// - Replays and `FailMode` work as for [`Call::run`]; with
///   `FailMode::Open` and the store down, the body's transaction is
///   committed on its own (`Outcome::Unprotected`).
///
/// ```no_run
/// use idem_core::Idempotency;
/// use idem_postgres::{PgStore, RunInTx};
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Idem(#[from] idem_core::Error),
///     #[error("database: {0}")]
///     Db(#[from] sqlx::Error),
/// }
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), AppError> {
/// let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).namespace("orders").build();
/// let order_id: i64 = idem
///     .call("orders.create", "req-42")
///     .run_in_tx(&pool, async |tx| {
///         let row: (i64,) = sqlx::query_as("INSERT INTO orders (amount) VALUES (500) RETURNING id")
///             .fetch_one(&mut *tx)
///             .await?;
///         Ok::<_, AppError>(row.0)
///     })
///     .await?;
/// # Ok(()) }
/// ```
///
/// - A holder killed mid-body (SIGKILL, a lost machine) leaves its claim,
///   committed before the body began, and nothing of its body (the
///   transaction aborts with its connection): the key answers
///   `InProgress` until the claim's lease ends, then the next call takes
///   it over as `Outcome::Recovered`.
///
/// SQL built at run time goes through `sqlx::AssertSqlSafe` (sqlx 0.9
/// takes a `&'static str` as it is), from the sqlx this crate re-exports
/// (`idem_postgres::sqlx`, `idem::postgres::sqlx` in the facade), so that
/// no sqlx of your own is needed. Only for text your program made: bind
/// values with `.bind(..)`.
///
/// ```no_run
/// use idem_core::Idempotency;
/// use idem_postgres::sqlx::{self, AssertSqlSafe, PgPool};
/// use idem_postgres::{PgStore, RunInTx};
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Idem(#[from] idem_core::Error),
///     #[error("database: {0}")]
///     Db(#[from] sqlx::Error),
/// }
///
/// # async fn demo(pool: PgPool, table: &str, id: String) -> Result<(), AppError> {
/// let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).build();
/// let id: String = idem
///     .call("orders.create", &id)
///     .run_in_tx(&pool, async |tx| {
///         let sql = format!("INSERT INTO {table} (id) VALUES ($1)"); // built at run time
///         sqlx::query(AssertSqlSafe(sql)).bind(&id).execute(&mut *tx).await?;
///         Ok::<_, AppError>(id.clone())
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub trait RunInTx: Sized {
    /// Runs `body` in a transaction at most once for this key; its writes
    /// and its result commit together. Returns what `Call::run` returns.
    #[allow(async_fn_in_trait)]
    async fn run_in_tx<F, T, E>(self, pool: &PgPool, body: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>;

    /// Like [`run_in_tx`](RunInTx::run_in_tx), also saying what happened
    /// (`Executed`, `Replayed`, `Recovered`, `Unprotected`).
    #[allow(async_fn_in_trait)]
    async fn run_in_tx_outcome<F, T, E>(self, pool: &PgPool, body: F) -> Result<(T, Outcome), E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>;
}

impl RunInTx for Call<'_> {
    async fn run_in_tx<F, T, E>(self, pool: &PgPool, body: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        self.run_in_tx_outcome(pool, body).await.map(|(v, _)| v)
    }

    async fn run_in_tx_outcome<F, T, E>(self, pool: &PgPool, body: F) -> Result<(T, Outcome), E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let slot = Arc::new(TxSlot::new(pool.clone()));
        let in_body = Arc::clone(&slot);
        // A dropped transaction rolls back: cancelling undoes the body, so
        // the key is released at once rather than held for the lease.
        let run = self.release_on_cancel().run_outcome(move || async move {
            if !in_body.lock().claimed_by_pg {
                return Err(E::from(Error::InvalidConfig(
                    "run_in_tx needs an Idempotency built over a PgStore (e.g. \
                     `Idempotency::builder(PgStore::from_pool(pool.clone()))`)"
                        .to_owned(),
                )));
            }
            // On the claim's connection when it kept one (no pool round
            // trips), else (FailMode::Open without a claim, or a store on
            // another pool) a new one. `Transaction::begin` on a pooled
            // connection is what sqlx's own `Pool::begin` calls (public,
            // hidden from its docs).
            let kept = in_body.lock().conn.take();
            let begun = match kept {
                Some(conn) => Transaction::begin(MaybePoolConnection::from(conn), None).await,
                None => pool.begin().await,
            };
            let mut txn = begun.map_err(|e| E::from(errors::map("begin", "", e)))?;
            // Hidden from the body: idem calls it makes are plain calls.
            // A fresh message count per run, so a re-run after a rollback
            // publishes the same names, hence the same ids.
            let publishing = in_body.lock().publishing.as_ref().map(|p| Arc::new(p.again()));
            let ran = match publishing {
                Some(p) => outbox::scope(p, SLOT.scope(None, body(&mut txn))).await,
                None => SLOT.scope(None, body(&mut txn)).await,
            };
            match ran {
                Ok(value) => {
                    in_body.lock().txn = Some(txn);
                    Ok(value)
                }
                Err(e) => {
                    // Roll back before idem-core releases the key, so the
                    // next holder never waits on this transaction's locks.
                    if let Err(err) = txn.rollback().await {
                        tracing::debug!(error = %err, "rollback after the body's error failed; the server aborts it with the connection");
                    }
                    Err(e)
                }
            }
        });
        let (value, outcome) = SLOT.scope(Some(Arc::clone(&slot)), run).await?;
        let (txn, failure) = {
            let mut s = slot.lock();
            (s.txn.take(), s.failure.take())
        };
        match outcome {
            Outcome::LeaseLost | Outcome::NotStored => {
                Err(E::from(failure.unwrap_or(Error::LeaseLost)))
            }
            Outcome::Unprotected => {
                // The store was down (FailMode::Open): no record to join,
                // so the body's own writes commit alone.
                if let Some(txn) = txn {
                    txn.commit()
                        .await
                        .map_err(|e| E::from(errors::map("commit", "", e)))?;
                }
                Ok((value, outcome))
            }
            _ => Ok((value, outcome)),
        }
    }
}
