//! `PgStore`: the state machine of `idem_core::Store` in one PostgreSQL table.

use crate::claim_path::{ClaimPath, Forecast};
use crate::config::{PgStoreConfig, TableName};
use crate::errors::{self, map};
use crate::schema;
use crate::schema::LEASE_LOST;
use crate::sql::{Statements, claim_col};
use crate::tx::{self, TxSlot};
use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    Claim, ClaimReply, Completed, Error, Fingerprint, RecordInfo, ScanPage, Store, Token,
    ValueKind, WriteReply,
};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection, Postgres, Row, Transaction};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Longest lease or TTL kept, in ms (about 317 years), as idem-core's
/// stores clamp it, so that timestamps never overflow.
const MAX_STORE_MS: u64 = 10_000_000_000_000;

/// How many times a claim or write is re-run when the row changed between
/// the refused write and its read-back (see `sql.rs`). Each re-run means
/// another caller's write landed in between, so a handful is plenty.
const MAX_RACES: usize = 16;

/// Idempotency records in a PostgreSQL table, with exactly the semantics of
/// idem's `RedisStore` and `MemoryStore`: leases, takeovers, owner tokens,
/// fingerprints and TTLs counted from the claim, all on the database's
/// clock. Cheap to clone (it shares one pool).
///
/// Each method is one statement in its own implicit transaction (READ
/// COMMITTED, autocommit), so it is never caught in a caller's snapshot.
/// A claim costs one round trip, and so does a replay: the claim statement
/// returns the completed row it found. Which statement goes first follows
/// the store's recent claims (mostly new keys: a bare insert; mostly kept
/// records: a bare read; a mix: one that does both); a call that goes
/// against the trend pays a second statement.
///
/// ```no_run
/// use idem_core::Idempotency;
/// use idem_postgres::PgStore;
/// # async fn demo() -> Result<(), idem_core::Error> {
/// let store = PgStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let idem = Idempotency::builder(store).namespace("orders").build();
/// let v: Result<u64, idem_core::Error> = idem.call("orders.create", "o-1").run(|| async { Ok(7) }).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) table: TableName,
    pub(crate) sql: Statements,
    pub(crate) forecast: Forecast,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.table.to_string())
            .field("pool_size", &self.inner.pool.size())
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// Connects a pool to `url` with the default table (`idem_keys`).
    /// Fails with [`Error::Unavailable`] when the server cannot be reached.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_postgres::PgStore::connect("postgres://postgres@127.0.0.1/app").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<PgStore, Error> {
        PgStore::connect_with(url, PgStoreConfig::default()).await
    }

    /// Connects a pool to `url`, with `config`.
    ///
    /// ```no_run
    /// use idem_postgres::{PgStore, PgStoreConfig};
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = PgStore::connect_with("postgres://postgres@127.0.0.1/app", PgStoreConfig::table("billing.idem_keys")).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(url: &str, config: PgStoreConfig) -> Result<PgStore, Error> {
        let table = config.table_ident()?;
        let fail = |e| {
            let e = map("connect", &table.to_string(), e);
            tracing::warn!(error = %e, "cannot connect to PostgreSQL");
            e
        };
        let options: PgConnectOptions = url.parse().map_err(fail)?;
        // One direct attempt first: a server that refuses connections is
        // reported now, not after the pool's retries for its acquire timeout.
        let probe = PgConnection::connect_with(&options).await.map_err(fail)?;
        let _ = probe.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            // A caller waiting on a dead server is better told soon.
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options);
        Ok(PgStore::build(pool, table))
    }

    /// A store over an existing pool (the one the application already uses:
    /// `run_in_tx` needs the table in the database its pool connects to).
    /// The pool should have a connection to spare for each body running in
    /// `run_in_tx` at once, since their lease renewals use the pool.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let store = idem_postgres::PgStore::from_pool(pool.clone());
    /// # }
    /// ```
    pub fn from_pool(pool: PgPool) -> PgStore {
        PgStore::build(pool, TableName::default_table())
    }

    /// A store over an existing pool, with `config`; fails with
    /// [`Error::InvalidConfig`] for a table name that cannot be used.
    ///
    /// ```no_run
    /// use idem_postgres::{PgStore, PgStoreConfig};
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), idem_core::Error> {
    /// let store = PgStore::from_pool_with(pool, PgStoreConfig::table("app.idem_keys"))?;
    /// # Ok(()) }
    /// ```
    pub fn from_pool_with(pool: PgPool, config: PgStoreConfig) -> Result<PgStore, Error> {
        Ok(PgStore::build(pool, config.table_ident()?))
    }

    fn build(pool: PgPool, table: TableName) -> PgStore {
        let sql = Statements::new(&table);
        PgStore {
            inner: Arc::new(Inner {
                pool,
                table,
                sql,
                forecast: Forecast::default(),
            }),
        }
    }

    /// The pool this store uses.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) {
    /// let pool: &sqlx::PgPool = store.pool();
    /// # }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Creates the table and its index if they are missing, and the table
    /// of failure counts beside it (`<table>_failures`, with its index),
    /// and creates or replaces its two functions (`<table>_claim`,
    /// `<table>_complete_in_tx`), so calling it after an upgrade brings an
    /// existing table up to date. Safe to call at every start, from several
    /// processes at once (an advisory lock serializes them). The schema itself is not created: a
    /// schema-qualified table needs its schema to exist.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
    /// store.migrate().await?;
    /// store.migrate().await?; // nothing to do the second time
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), Error> {
        let table = self.inner.table.to_string();
        let fail = |e| map("migrate", &table, e);
        let mut tx = self.inner.pool.begin().await.map_err(fail)?;
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in the
        // catalog (a unique violation on pg_type): take turns. One lock for
        // every table, since two spellings can name the same one.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem-postgres migrate'))")
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        for statement in schema::ddl(&self.inner.table) {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        tracing::debug!(table, "idem-postgres schema is in place");
        Ok(())
    }

    /// Same as [`migrate`](PgStore::migrate).
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
    /// store.install_schema().await?;
    /// # Ok(()) }
    /// ```
    pub async fn install_schema(&self) -> Result<(), Error> {
        self.migrate().await
    }

    /// The DDL that [`migrate`](PgStore::migrate) runs for this store's
    /// table, as a script for teams that run their own migrations
    /// (`idem-postgres/schema.sql` is this for the default table).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let pool = sqlx::PgPool::connect_lazy("postgres://localhost/app").unwrap();
    /// let store = idem_postgres::PgStore::from_pool(pool);
    /// assert!(store.schema_sql().contains("CREATE TABLE IF NOT EXISTS \"idem_keys\""));
    /// # }
    /// ```
    pub fn schema_sql(&self) -> String {
        schema::script(&self.inner.table)
    }

    pub(crate) fn table_str(&self) -> String {
        self.inner.table.to_string()
    }

    pub(crate) fn fail(&self, op: &'static str) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| map(op, &self.table_str(), e)
    }

    /// Runs a write statement (`complete`, `release`, `extend`): one row
    /// changed is the answer; none, and `classify` says why, re-running the
    /// write while that read contradicts the refusal (the row changed in
    /// between).
    async fn write(
        &self,
        op: &'static str,
        sql: &Arc<str>,
        key: &str,
        token: &[u8; 16],
        third: Third,
        fourth: Option<&[u8]>,
    ) -> Result<WriteState, Error> {
        for _ in 0..MAX_RACES {
            let mut q = sqlx::query(AssertSqlSafe(Arc::clone(sql)))
                .bind(key)
                .bind(&token[..]);
            q = match third {
                Third::Kind(k) => q.bind(k),
                Third::Ms(ms) => q.bind(ms),
                Third::None => q,
            };
            if let Some(v) = fourth {
                q = q.bind(v);
            }
            let done = q
                .execute(&self.inner.pool)
                .await
                .map_err(self.fail(op))?
                .rows_affected();
            if done > 0 {
                return Ok(WriteState::Reply(WriteReply::Done));
            }
            // `same` compares the stored record with this write's, which
            // only a `complete` has.
            let (kind, value) = match third {
                Third::Kind(k) => (k, fourth.unwrap_or_default()),
                _ => (0, &[][..]),
            };
            match self.classify(op, key, token, kind, value).await? {
                WriteState::Ours => continue,
                state => return Ok(state),
            }
        }
        Err(errors::unavailable(
            op,
            "the record kept changing under this write; retry",
        ))
    }

    /// Completes inside the body's transaction (see `tx.rs`): a
    /// compare-and-set on the owner token, then commit.
    async fn complete_in_tx(
        &self,
        slot: &TxSlot,
        mut txn: Transaction<'static, Postgres>,
        key: &str,
        token: &[u8; 16],
        kind: i8,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        // The CAS and the COMMIT travel in one message (simple query
        // protocol), so `run_in_tx` costs one round trip over the body's
        // own transaction: the claim. A CAS that touches no row raises
        // `LEASE_LOST`, which stops the message before its COMMIT. Values travel
        // hex-encoded, so nothing in them can end the literal.
        let script = self.inner.sql.cas_and_commit(key, token, kind, value);
        let cas = sqlx::raw_sql(AssertSqlSafe(script))
            .execute(&mut *txn)
            .await;
        let failure = match cas {
            Ok(_) => {
                // Committed; the `BEGIN` after the COMMIT left an empty
                // transaction open, which dropping `txn` rolls back with the
                // connection's next use (no round trip now, no WAL).
                drop(txn);
                slot.committed();
                return Ok(WriteReply::Done);
            }
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(LEASE_LOST) => {
                // The CAS touched no row: the lease is no longer ours.
                rollback(txn).await;
                let reply = match self.classify("complete", key, token, kind, value).await? {
                    WriteState::Reply(r) => r,
                    WriteState::Ours | WriteState::TxBound => WriteReply::Missing,
                };
                tracing::warn!(
                    ?reply,
                    "the lease was lost before the body's transaction could commit: rolled back, nothing of the body was kept"
                );
                slot.failed(Error::LeaseLost);
                return Ok(reply);
            }
            Err(e) if matches!(e, sqlx::Error::Database(_)) => {
                rollback(txn).await;
                e
            }
            Err(e) => {
                // The connection broke mid-message: the COMMIT may or may
                // not have landed. The record tells: idem re-sends
                // `complete`, which finds it completed (committed) or still
                // ours (rolled back, then released).
                let e = self.fail("complete")(e);
                slot.failed(Error::Unavailable {
                    op: "complete",
                    reason: format!(
                        "{e}; the body's transaction did not commit and the key was released: \
                         retry with the same key"
                    ),
                });
                return Err(e);
            }
        };
        // The database refused the CAS or the commit: the transaction rolled
        // back, so the key is released for the next call to run.
        let e = self.fail("complete")(failure);
        let e = match e {
            Error::Conflict { .. } => e,
            other => Error::Unavailable {
                op: "commit",
                reason: format!(
                    "the body's transaction could not commit ({other}); nothing was committed and \
                     the key was released. If the body caught a failed statement and returned Ok, \
                     return its error instead (an aborted transaction cannot commit)"
                ),
            },
        };
        tracing::warn!(error = %e, "the body's transaction was rolled back; releasing the key");
        let _ = self
            .write(
                "release",
                &self.inner.sql.release,
                key,
                token,
                Third::None,
                None,
            )
            .await;
        slot.failed(e);
        Ok(WriteReply::Missing)
    }

    /// Reads the row as it is now (a fresh statement, so a fresh snapshot).
    async fn classify(
        &self,
        op: &'static str,
        key: &str,
        token: &[u8; 16],
        kind: i8,
        value: &[u8],
    ) -> Result<WriteState, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.classify)))
            .bind(key)
            .bind(kind)
            .bind(value)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail(op))?;
        read_write_row(row.as_ref(), token)
    }
}

/// The third bound parameter of a write statement.
#[derive(Clone, Copy)]
enum Third {
    Kind(i8),
    Ms(i64),
    None,
}

/// What a write statement's reply says.
#[derive(Debug)]
enum WriteState {
    Reply(WriteReply),
    /// The read-back shows the caller's own pending record: the row changed
    /// between the refused write and the read. Re-run.
    Ours,
    /// The caller's own pending record, claimed by `run_in_tx`: only its
    /// transaction may complete it.
    TxBound,
}

fn read_write_row(row: Option<&PgRow>, token: &[u8; 16]) -> Result<WriteState, Error> {
    let Some(row) = row else {
        return Ok(WriteState::Reply(WriteReply::Missing));
    };
    let done: bool = get(row, "done")?;
    if done {
        return Ok(WriteState::Reply(WriteReply::Done));
    }
    let live: Option<bool> = get(row, "live")?;
    if live != Some(true) {
        return Ok(WriteState::Reply(WriteReply::Missing));
    }
    let state: Option<i8> = get(row, "state")?;
    let state = state.map(|s| s as u8);
    match state {
        Some(b'P') => {
            let stored: Option<Vec<u8>> = get(row, "token")?;
            match stored {
                Some(t) if t.len() == 16 && t[..] == token[..] => {
                    let in_tx: Option<bool> = get(row, "in_tx")?;
                    Ok(if in_tx == Some(true) {
                        WriteState::TxBound
                    } else {
                        WriteState::Ours
                    })
                }
                Some(t) if t.len() == 16 => Ok(WriteState::Reply(WriteReply::OtherOwner)),
                _ => Err(corrupt("a pending record without a 16-byte owner token")),
            }
        }
        Some(tag) if ValueKind::from_tag(tag).is_some() => {
            let same: Option<bool> = get(row, "same")?;
            Ok(WriteState::Reply(if same == Some(true) {
                WriteReply::Done
            } else {
                WriteReply::AlreadyCompleted
            }))
        }
        other => Err(corrupt(&format!(
            "unknown state {:?}",
            other.map(char::from)
        ))),
    }
}

/// A column to read: by name, or by position with its name for errors (the
/// claim's columns, `sql::claim_col`: no name lookups on the hottest path).
pub(crate) trait Column {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>;
    fn name(&self) -> &str;
}

impl Column for &str {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        row.try_get(*self)
    }
    fn name(&self) -> &str {
        self
    }
}

impl Column for claim_col::Col {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        row.try_get(self.0)
    }
    fn name(&self) -> &str {
        self.1
    }
}

/// One column of a row idem wrote; one it cannot decode makes the row
/// `Error::Corrupt`.
pub(crate) fn get<'r, T>(row: &'r PgRow, column: impl Column) -> Result<T, Error>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    column
        .read(row)
        .map_err(|e| corrupt(&format!("column {}: {e}", column.name())))
}

pub(crate) fn corrupt(what: &str) -> Error {
    Error::Corrupt(format!(
        "{what}; the row was not written by idem-postgres (or was edited by hand) and was left \
         as it is — delete it, or use a table of its own for idem"
    ))
}

async fn rollback(txn: Transaction<'static, Postgres>) {
    if let Err(e) = txn.rollback().await {
        // The connection is gone: the server rolls back on its own.
        tracing::debug!(error = %e, "rollback failed; the server aborts the transaction with the connection");
    }
}

/// The 16 raw bytes of a token's 32 hex digits.
pub(crate) fn token_bytes(token: &Token) -> [u8; 16] {
    let hex = token.as_bytes();
    let mut out = [0u8; 16];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = (nibble(hex[2 * i]) << 4) | nibble(hex[2 * i + 1]);
    }
    out
}

fn nibble(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        b'A'..=b'F' => b - b'A' + 10,
        _ => 0,
    }
}

/// A duration as the stores count it: whole ms, at least 1, clamped.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, MAX_STORE_MS)
}

/// The lease as idem-core's stores count it: at most half the longest TTL.
fn lease_ms(lease: Duration) -> u64 {
    millis(lease).min(MAX_STORE_MS / 2)
}

/// How long a claimed record is kept: the result TTL and at least two
/// leases, so that a lease that runs out leaves a record and the next claim
/// counts a takeover instead of finding a fresh key. The same rule as
/// idem-core's `record_ttl` (crate-private there).
fn record_ttl_ms(ttl: Duration, lease: Duration) -> u64 {
    millis(ttl).max(lease_ms(lease) * 2)
}

fn ms_i64(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// Time left, as an interval between two database timestamps, in whole ms
/// rounded up (as the other stores count it). Such an interval has days
/// and microseconds only; months are counted as 30 days all the same.
fn interval_ms(left: Option<PgInterval>) -> Option<i64> {
    left.map(|i| {
        let days = i64::from(i.months) * 30 + i64::from(i.days);
        let us = days
            .saturating_mul(86_400_000_000)
            .saturating_add(i.microseconds);
        us.div_euclid(1000) + i64::from(us.rem_euclid(1000) > 0)
    })
}

fn duration_ms(ms: Option<i64>) -> Duration {
    Duration::from_millis(ms.and_then(|m| u64::try_from(m).ok()).unwrap_or(0))
}

fn mismatch(given: Option<&Fingerprint>, stored: Option<&[u8]>) -> bool {
    matches!((given, stored), (Some(a), Some(b)) if a.as_bytes()[..] != *b)
}

/// What one claim statement answered.
enum ClaimRead {
    Reply(ClaimReply),
    /// The statement cannot answer: it was one-sided (`claim_path.rs`), or
    /// its snapshot says the claim should have won. Run the combined one.
    Race,
}

/// The bare insert's answer: the key is won, or it was present (the
/// combined statement then decides).
fn read_insert(row: Option<&PgRow>) -> Result<ClaimRead, Error> {
    let Some(row) = row else {
        return Ok(ClaimRead::Race);
    };
    acquired(get(row, claim_col::INSERTED)?)
}

fn acquired(attempt: i64) -> Result<ClaimRead, Error> {
    let attempt = u32::try_from(attempt).map_err(|_| corrupt("attempt out of range"))?;
    Ok(ClaimRead::Reply(ClaimReply::Acquired { attempt }))
}

fn read_claim(row: Option<&PgRow>, c: &Claim<'_>, token: &[u8; 16]) -> Result<ClaimRead, Error> {
    let Some(row) = row else {
        // The bare read answers none for an absent key; the combined
        // statement always answers one row, so none there means a changed
        // table.
        return Ok(ClaimRead::Race);
    };
    let won: Option<i64> = get(row, claim_col::WON)?;
    if let Some(attempt) = won {
        return acquired(attempt);
    }
    let attempt: Option<i64> = get(row, claim_col::ATTEMPT)?;
    let ttl_ms = interval_ms(get(row, claim_col::TTL_LEFT)?);
    if ttl_ms.is_none_or(|t| t <= 0) {
        return Ok(ClaimRead::Race);
    }
    let state: Option<i8> = get(row, claim_col::STATE)?;
    let fingerprint: Option<Vec<u8>> = get(row, claim_col::FINGERPRINT)?;
    if fingerprint.as_ref().is_some_and(|f| f.len() != 16) {
        return Err(corrupt("a fingerprint that is not 16 bytes"));
    }
    let fp = fingerprint.as_deref();
    match state.map(|s| s as u8) {
        Some(b'P') => {
            let stored: Option<Vec<u8>> = get(row, claim_col::TOKEN)?;
            let lease_ms = interval_ms(get(row, claim_col::LEASE_LEFT)?);
            let valid = stored.as_ref().is_some_and(|t| t.len() == 16)
                && attempt.is_some_and(|a| (1..=i64::from(u32::MAX)).contains(&a))
                && lease_ms.is_some();
            if !valid {
                return Err(corrupt(
                    "a pending record with a bad owner token, attempt or lease",
                ));
            }
            if mismatch(c.fingerprint, fp) {
                return Ok(ClaimRead::Reply(ClaimReply::Mismatch));
            }
            match lease_ms {
                Some(left) if left > 0 && stored.as_deref() != Some(&token[..]) => {
                    Ok(ClaimRead::Reply(ClaimReply::InProgress {
                        retry_after: duration_ms(Some(left)),
                    }))
                }
                _ => Ok(ClaimRead::Race),
            }
        }
        Some(tag) => {
            let Some(kind) = ValueKind::from_tag(tag) else {
                return Err(corrupt(&format!("unknown state {:?}", char::from(tag))));
            };
            if mismatch(c.fingerprint, fp) {
                return Ok(ClaimRead::Reply(ClaimReply::Mismatch));
            }
            let value: Option<Vec<u8>> = get(row, claim_col::VALUE)?;
            let value = value.ok_or_else(|| corrupt("a completed record without a value"))?;
            Ok(ClaimRead::Reply(ClaimReply::Completed(Completed {
                kind,
                value: Bytes::from(value),
                fingerprint: fp.and_then(Fingerprint::from_bytes),
                ttl_left: Some(duration_ms(ttl_ms)),
            })))
        }
        None => Err(corrupt("a record without a state")),
    }
}

#[async_trait]
impl Store for PgStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        let token = token_bytes(c.token);
        let slot = tx::current();
        if let Some(slot) = &slot {
            slot.note_claim(token);
        }
        let lease = ms_i64(lease_ms(c.lease));
        let ttl = ms_i64(record_ttl_ms(c.ttl, c.lease));
        let fingerprint = c.fingerprint.map(|f| &f.as_bytes()[..]);
        // A `run_in_tx` claim runs on a connection of the caller's pool,
        // which the body's transaction then opens on (see `tx.rs`).
        let mut conn = match &slot {
            Some(slot) => match slot.claim_conn(&self.inner.pool).await {
                Some(conn) => Some(conn.map_err(self.fail("claim"))?),
                None => None,
            },
            None => None,
        };
        let mut path = self.inner.forecast.path();
        for _ in 0..MAX_RACES {
            let sql = &self.inner.sql;
            let q = match path {
                ClaimPath::Insert => sqlx::query(AssertSqlSafe(Arc::clone(match slot {
                    Some(_) => &sql.claim_insert_tx,
                    None => &sql.claim_insert,
                })))
                .bind(c.key)
                .bind(&token[..])
                .bind(lease)
                .bind(ttl)
                .bind(fingerprint),
                ClaimPath::Read => {
                    sqlx::query(AssertSqlSafe(Arc::clone(&sql.claim_read))).bind(c.key)
                }
                ClaimPath::Combined => sqlx::query(AssertSqlSafe(Arc::clone(&sql.claim)))
                    .bind(c.key)
                    .bind(&token[..])
                    .bind(lease)
                    .bind(ttl)
                    .bind(fingerprint)
                    .bind(slot.is_some()),
            };
            let row = match conn.as_mut() {
                Some(conn) => q.fetch_optional(&mut **conn).await,
                None => q.fetch_optional(&self.inner.pool).await,
            }
            .map_err(self.fail("claim"))?;
            let read = match path {
                ClaimPath::Insert => read_insert(row.as_ref())?,
                _ => read_claim(row.as_ref(), &c, &token)?,
            };
            // Whatever the first statement could not answer, the combined
            // one can.
            path = ClaimPath::Combined;
            if let ClaimRead::Reply(reply) = read {
                let won = matches!(reply, ClaimReply::Acquired { .. });
                self.inner.forecast.observe(!won);
                if let (true, Some(slot), Some(conn)) = (won, &slot, conn) {
                    slot.keep_conn(conn);
                }
                return Ok(reply);
            }
        }
        Err(errors::unavailable(
            "claim",
            "the record kept changing under this claim; retry",
        ))
    }

    async fn complete(
        &self,
        key: &str,
        token: &Token,
        _fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let token = token_bytes(token);
        let tag = kind.tag() as i8;
        // A `run_in_tx` call's own complete: inside the body's transaction.
        if let Some(slot) = tx::current()
            && let Some(txn) = slot.take_tx(&token)
        {
            return self
                .complete_in_tx(&slot, txn, key, &token, tag, value)
                .await;
        }
        let sql = &self.inner.sql;
        let first = self
            .write(
                "complete",
                &sql.complete,
                key,
                &token,
                Third::Kind(tag),
                Some(value),
            )
            .await;
        match first {
            Ok(WriteState::Reply(r)) => Ok(r),
            // A `run_in_tx` claim completed outside its transaction: that
            // transaction did not commit (or this would find the record
            // completed), so its writes are gone: release instead.
            Ok(WriteState::TxBound) => self.resolve_in_tx(key, &token, tag, value).await,
            Ok(WriteState::Ours) => Ok(WriteReply::Missing),
            Err(e) => Err(e),
        }
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let token = token_bytes(token);
        match self
            .write(
                "release",
                &self.inner.sql.release,
                key,
                &token,
                Third::None,
                None,
            )
            .await?
        {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let token = token_bytes(token);
        let ms = ms_i64(lease_ms(lease));
        match self
            .write(
                "extend",
                &self.inner.sql.extend,
                key,
                &token,
                Third::Ms(ms),
                None,
            )
            .await?
        {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }

    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        self.inspect_row(key, with_value).await
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        self.forget_row(key, force).await
    }

    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let sql = &self.inner.sql;
        let fail = |e| errors::map_failures("count_failure", &sql.failures_table, e);
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&sql.count_failure)))
            .bind(key)
            .bind(ms_i64(millis(ttl)))
            .fetch_one(&self.inner.pool)
            .await
            .map_err(fail)?;
        let count: i64 = row
            .try_get(0)
            .map_err(|e| corrupt(&format!("column failures: {e}")))?;
        u32::try_from(count).map_err(|_| {
            corrupt(&format!(
                "the failure count {count} in {} is out of range",
                sql.failures_table
            ))
        })
    }

    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        self.scan_page(prefix, cursor, count).await
    }
}

impl PgStore {
    async fn resolve_in_tx(
        &self,
        key: &str,
        token: &[u8; 16],
        tag: i8,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.resolve_in_tx)))
            .bind(key)
            .bind(&token[..])
            .bind(tag)
            .bind(value)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail("complete"))?;
        if row_done(row.as_ref()) {
            tracing::warn!(
                "the body's transaction did not commit: nothing of it was kept; the key was released"
            );
            if let Some(slot) = tx::current() {
                slot.failed_if_unset(Error::LeaseLost);
            }
            return Ok(WriteReply::Missing);
        }
        match read_write_row(row.as_ref(), token)? {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }
}

fn row_done(row: Option<&PgRow>) -> bool {
    row.is_some_and(|r| r.try_get::<bool, _>("done").unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(days: i32, microseconds: i64) -> Option<PgInterval> {
        Some(PgInterval {
            months: 0,
            days,
            microseconds,
        })
    }

    #[test]
    fn intervals_count_whole_ms_rounded_up() {
        assert_eq!(interval_ms(None), None);
        assert_eq!(interval_ms(iv(0, 1)), Some(1));
        assert_eq!(interval_ms(iv(0, 1000)), Some(1));
        assert_eq!(interval_ms(iv(0, 1001)), Some(2));
        assert_eq!(interval_ms(iv(0, -1500)), Some(-1));
        assert_eq!(interval_ms(iv(0, -1000)), Some(-1));
        assert_eq!(interval_ms(iv(1, 0)), Some(86_400_000));
        // the longest record idem keeps (about 317 years) does not overflow
        assert_eq!(interval_ms(iv(115_741, 0)), Some(115_741 * 86_400_000));
    }
}
