//! `PgStore`: its pool and rendered statements, its constructors and its
//! migration. What it does as an `idem_core::store::Store` is in `store_impl.rs`
//! (claims), `write.rs` (completes, releases, extends) and `operate.rs`.

use crate::claim_path::Forecast;
use crate::config::Partitioning;
use crate::config::{PgStoreConfig, TableName};
use crate::errors::map;
use crate::outbox::table::OutboxSql;
use crate::schema;
use crate::sql::Statements;
use idem_core::Error;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

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
    pub(crate) outbox: Arc<OutboxSql>,
    /// Set for a partitioned store (`PgStoreConfig::partitioned`).
    pub(crate) partitioning: Option<Partitioning>,
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
        let partitioning = config.partitioning()?;
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
        Ok(PgStore::build(pool, table, partitioning))
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
        PgStore::build(pool, TableName::default_table(), None)
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
        Ok(PgStore::build(
            pool,
            config.table_ident()?,
            config.partitioning()?,
        ))
    }

    fn build(pool: PgPool, table: TableName, partitioning: Option<Partitioning>) -> PgStore {
        let sql = Statements::new(&table, partitioning.as_ref());
        PgStore {
            inner: Arc::new(Inner {
                outbox: Arc::new(OutboxSql::new(&table)),
                pool,
                table,
                sql,
                forecast: Forecast::default(),
                partitioning,
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
    /// Once this version's schema is in place (it leaves a stamp, the
    /// comment of `<table>_outbox_wake`), `migrate` only reads the catalog
    /// and takes no lock on the tables, so a process starting while others
    /// serve calls and relay messages neither waits for them nor holds them
    /// up. The first `migrate` of a new version, or after `schema.sql` was
    /// applied by hand, runs the DDL, whose `ALTER TABLE` and `CREATE
    /// TRIGGER` lock the tables briefly: run it before the new version
    /// takes traffic, as any migration.
    ///
    /// On a partitioned store it creates the partitioned tables, then runs
    /// [`maintain`](PgStore::maintain) once (the partitions of this period
    /// and the next); it refuses a table of the other layout.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
    /// store.migrate().await?;
    /// store.migrate().await?; // nothing to do the second time
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), Error> {
        self.install().await?;
        // A partitioned store's partitions of this period and the next.
        self.maintain().await.map(|_| ())
    }

    async fn install(&self) -> Result<(), Error> {
        let table = self.inner.table.to_string();
        let fail = |e| map("migrate", &table, e);
        let parts = self.inner.partitioning;
        let statements = schema::ddl(&self.inner.table, parts.as_ref());
        let stamp = schema::stamp(&statements);
        let in_place = schema::in_place(&self.inner.table);
        // Every process migrates at its start while the others work, and
        // even with everything in place the DDL locks tables
        // (`ALTER TABLE … IF NOT EXISTS` and `DROP TRIGGER` take ACCESS
        // EXCLUSIVE, `CREATE INDEX IF NOT EXISTS` SHARE, all held to the
        // commit): it would wait for any transaction in flight (a relay
        // pass waiting on its broker), queue every call behind it, and
        // deadlock with a pass that goes on to delete its rows. So the
        // schema this version creates, once in place, is recognised by its
        // stamp and left alone, without a lock.
        let current = |found: Option<bool>| found == Some(true);
        let found: Option<bool> = sqlx::query_scalar(AssertSqlSafe(in_place.as_str()))
            .bind(&stamp)
            .fetch_one(&self.inner.pool)
            .await
            .map_err(fail)?;
        if current(found) {
            tracing::debug!(table, "idem-postgres schema is in place");
            return Ok(());
        }
        let mut tx = self.inner.pool.begin().await.map_err(fail)?;
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in the
        // catalog (a unique violation on pg_type): take turns. One lock for
        // every table, since two spellings can name the same one.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem-postgres migrate'))")
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        // The process we waited for may have done it all.
        let found: Option<bool> = sqlx::query_scalar(AssertSqlSafe(in_place.as_str()))
            .bind(&stamp)
            .fetch_one(&mut *tx)
            .await
            .map_err(fail)?;
        if !current(found) {
            let kinds: (Option<String>, Option<String>) =
                sqlx::query_as(AssertSqlSafe(schema::kinds(&self.inner.table)))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(fail)?;
            let want = if parts.is_some() { "p" } else { "r" };
            for (kind, name) in [
                (kinds.0, table.clone()),
                (kinds.1, self.inner.outbox.table.clone()),
            ] {
                if kind.as_deref().is_some_and(|k| k != want) {
                    return Err(Error::InvalidConfig(format!(
                        "table {name} exists and is {found}, but this store is configured {wanted}: \
                         a table cannot change between the two in place; configure another table \
                         name with `PgStoreConfig::table(..)` (and move to it), or drop the table",
                        found = if want == "p" {
                            "not partitioned"
                        } else {
                            "partitioned"
                        },
                        wanted = if want == "p" {
                            "`partitioned(..)`"
                        } else {
                            "without `partitioned(..)`"
                        },
                    )));
                }
            }
            for statement in statements {
                sqlx::query(AssertSqlSafe(statement))
                    .execute(&mut *tx)
                    .await
                    .map_err(fail)?;
            }
            sqlx::query(AssertSqlSafe(schema::stamp_statement(
                &self.inner.table,
                &stamp,
            )))
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
        schema::script(&self.inner.table, self.inner.partitioning.as_ref())
    }

    pub(crate) fn table_str(&self) -> String {
        self.inner.table.to_string()
    }

    pub(crate) fn fail(&self, op: &'static str) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| map(op, &self.table_str(), e)
    }
}
