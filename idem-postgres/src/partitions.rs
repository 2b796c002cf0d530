//! Records and outbox partitioned by time (`PgStoreConfig::partitioned`):
//! the layout, and `PgStore::maintain`, which creates partitions ahead and
//! drops the ones nothing lives in any more.
//!
//! Each row carries `gen`, the period its insert fell in (the database
//! clock's seconds divided by the period), and both tables are
//! `PARTITION BY RANGE (gen)`, one partition per period, plus a default
//! partition that takes rows whose period has no partition yet (the
//! maintenance ran late), so an insert never fails for want of one.
//!
//! What changes for the records: PostgreSQL requires a partitioned table's
//! unique keys to include the partition key, so the primary key is
//! `(key, gen)` and a key can have rows in several partitions: at most one
//! live (unexpired) one, and expired ones left to their partition's drop.
//! Nothing unique stops two claims of a new key in two periods, so claims
//! of one key take turns on a transaction-level advisory lock (held by a
//! `run_in_tx` claim until its transaction ends, as the row lock of a plain
//! table's insert is). A takeover updates the live row where it is, so its
//! partition waits for it; a fresh claim always inserts into the current
//! period. `gen` never changes, so no update moves a row between partitions.
//!
//! Retention: a partition older than the previous period is dropped once no
//! row in it is live (records) or it holds no message (outbox: every one
//! relayed or dropped, none parked). The last check runs under an `ACCESS
//! EXCLUSIVE` lock on the parent, which waits for every transaction that
//! could still be inserting there; the lock is waited for at most
//! [`LOCK_WAIT`], so calls queue behind it no longer than that, and a
//! partition that cannot be locked now is tried at the next maintenance.
//! The default partition is reaped by `DELETE`, as the plain table is.

use crate::config::{RECORDS, TableName, storage};
use crate::errors::map;
use crate::outbox::table::OUTBOX_TABLE;
use crate::store::PgStore;
use idem_core::Error;
use sqlx::{AssertSqlSafe, Connection, Row};

/// Periods after the current one that get their partition ahead. Every
/// statement that cannot name a partition probes and locks them all, so
/// no more are made than the next period needs; the rows of a period that
/// maintenance did not reach go to the default partition.
const AHEAD: i64 = 1;
/// Longest wait for a DDL lock: calls on the table queue behind a waiting
/// `CREATE` or `DROP`, so it gives up soon and tries again later.
pub(crate) const LOCK_WAIT: &str = "300ms";
/// An outbox partition above this size (in 8 kB pages) whose rows were all
/// deleted is dropped only after vacuum truncated it: checking it for
/// rows would scan its dead ones under the exclusive lock.
const EMPTY_CHECK_PAGES: i64 = 1024;

/// The tables a partitioned store partitions: the suffix of their
/// partitions' names, and the parent's name.
fn parents(table: &TableName) -> [(Kind, String, String); 2] {
    [
        (Kind::Records, RECORDS.to_owned(), table.to_string()),
        (
            Kind::Outbox,
            format!("{OUTBOX_TABLE}_p"),
            table.beside(OUTBOX_TABLE),
        ),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Records,
    Outbox,
}

/// What one [`PgStore::maintain`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// Partitions created ahead of the periods they hold.
    pub created: u32,
    /// Partitions dropped: every record in them had expired, or every
    /// message was relayed or dropped.
    pub dropped: u32,
    /// Past partitions kept: a record in them is still live, a message
    /// waits (to be relayed, or parked), or vacuum has not yet truncated
    /// an outbox partition's deleted rows.
    pub kept: u32,
    /// Partitions whose `CREATE` or `DROP` could not have its lock within
    /// 300 ms (a long transaction on the table), or whose period already
    /// has rows in the default partition: tried again at the next call.
    pub deferred: u32,
}

impl PgStore {
    /// Keeps a partitioned store's partitions (see
    /// [`PgStoreConfig::partitioned`](crate::PgStoreConfig::partitioned)):
    /// creates the partitions of the next periods, and drops the past ones
    /// in which no record is live and no message waits. Does nothing on a
    /// plain table. [`spawn_reaper`](PgStore::spawn_reaper) calls it at
    /// every tick; call it yourself (from a cron, from every instance)
    /// if you run no reaper. Several at once take turns.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PgStore) -> Result<(), idem_core::Error> {
    /// let done = store.maintain().await?;
    /// println!("{} partitions dropped, {} waiting", done.dropped, done.kept);
    /// # Ok(()) }
    /// ```
    pub async fn maintain(&self) -> Result<Maintenance, Error> {
        let mut done = Maintenance::default();
        let Some(layout) = self.inner.partitioning else {
            return Ok(done);
        };
        let table = self.table_str();
        let fail = |e| map("maintain", &table, e);
        let mut conn = self.inner.pool.acquire().await.map_err(fail)?;
        let (current,): (i64,) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {}",
            layout.gen_of("clock_timestamp()")
        )))
        .fetch_one(&mut *conn)
        .await
        .map_err(fail)?;
        for (kind, suffix, parent) in parents(&self.inner.table) {
            let existing = partitions(&mut conn, &parent).await.map_err(fail)?;
            for generation in current..=current + AHEAD {
                if existing.iter().any(|(_, g)| *g == generation) {
                    continue;
                }
                let name = self.inner.table.beside(&format!("{suffix}{generation}"));
                let create = format!(
                    "CREATE TABLE IF NOT EXISTS {name} PARTITION OF {parent} \
                     FOR VALUES FROM ({generation}) TO ({next}){storage}",
                    next = generation + 1,
                    storage = storage(&suffix),
                );
                match ddl(&mut conn, &create).await.map_err(fail)? {
                    Ddl::Done => done.created += 1,
                    Ddl::Deferred => done.deferred += 1,
                }
            }
            for (name, generation) in existing {
                if generation > current - 2 {
                    continue;
                }
                match drop_if_unused(&mut conn, kind, &parent, &name)
                    .await
                    .map_err(fail)?
                {
                    Some(Ddl::Done) => done.dropped += 1,
                    Some(Ddl::Deferred) => done.deferred += 1,
                    None => done.kept += 1,
                }
            }
        }
        if done != Maintenance::default() {
            tracing::debug!(?done, table, "idem-postgres partitions maintained");
        }
        Ok(done)
    }
}

/// `parent`'s range partitions: their names (as the catalog quotes them)
/// and the period each holds. The default partition is not listed.
async fn partitions(
    conn: &mut sqlx::PgConnection,
    parent: &str,
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT c.oid::regclass::text AS name, \
                (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''?(-?[0-9]+)''?\\)'))[1]::bigint AS gen \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1)",
    )
    .bind(parent)
    .fetch_all(&mut *conn)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(generation) = row.try_get::<Option<i64>, _>("gen")? {
            out.push((row.try_get("name")?, generation));
        }
    }
    Ok(out)
}

enum Ddl {
    Done,
    Deferred,
}

/// Runs `statement` in a transaction that waits at most [`LOCK_WAIT`] for
/// its locks, and takes turns with other maintainers (a second one skips).
async fn ddl(conn: &mut sqlx::PgConnection, statement: &str) -> Result<Ddl, sqlx::Error> {
    let Some(mut tx) = turn(conn).await? else {
        return Ok(Ddl::Deferred);
    };
    match sqlx::query(AssertSqlSafe(statement.to_owned()))
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {
            tx.commit().await?;
            Ok(Ddl::Done)
        }
        Err(e) if deferred(&e) => Ok(Ddl::Deferred),
        Err(e) => Err(e),
    }
}

/// Drops the partition `name` of `parent` when nothing in it is in use,
/// checked once without a lock (cheap: most past partitions are still in
/// use when first looked at) and again under the parent's exclusive lock.
/// `None`: kept.
async fn drop_if_unused(
    conn: &mut sqlx::PgConnection,
    kind: Kind,
    parent: &str,
    name: &str,
) -> Result<Option<Ddl>, sqlx::Error> {
    let in_use = match kind {
        // Via the BRIN index on `expires_at`, summarized first: a range of
        // pages whose latest expiry has passed is skipped unread.
        Kind::Records => {
            format!("SELECT EXISTS (SELECT 1 FROM {name} WHERE expires_at > clock_timestamp())")
        }
        Kind::Outbox => format!(
            "SELECT EXISTS (SELECT 1 FROM {name}) \
                 OR pg_relation_size('{quoted}'::regclass) > {EMPTY_CHECK_PAGES} * current_setting('block_size')::bigint",
            quoted = name.replace('\'', "''"),
        ),
    };
    if kind == Kind::Records {
        summarize(conn, name).await?;
    }
    let mut tx = conn.begin().await?;
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await?;
    let (busy,): (bool,) = sqlx::query_as(AssertSqlSafe(in_use.clone()))
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    if busy {
        return Ok(None);
    }
    let Some(mut tx) = turn(conn).await? else {
        return Ok(Some(Ddl::Deferred));
    };
    let dropped = async {
        sqlx::query("SET LOCAL enable_seqscan = off")
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!(
            "LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE"
        )))
        .execute(&mut *tx)
        .await?;
        let (busy,): (bool,) = sqlx::query_as(AssertSqlSafe(in_use))
            .fetch_one(&mut *tx)
            .await?;
        if !busy {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {name}")))
                .execute(&mut *tx)
                .await?;
        }
        Ok::<_, sqlx::Error>(!busy)
    }
    .await;
    match dropped {
        Ok(true) => {
            tx.commit().await?;
            Ok(Some(Ddl::Done))
        }
        Ok(false) => Ok(None),
        Err(e) if deferred(&e) => Ok(Some(Ddl::Deferred)),
        Err(e) => Err(e),
    }
}

/// Summarizes the page ranges of the partition's BRIN index that no vacuum
/// has yet, so that the live-row check skips them.
async fn summarize(conn: &mut sqlx::PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT brin_summarize_new_values(i.indexrelid) FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam \
         WHERE i.indrelid = $1::regclass AND a.amname = 'brin'",
    )
    .bind(name)
    .fetch_all(&mut *conn)
    .await?;
    Ok(())
}

/// The transaction of one DDL step: it waits at most [`LOCK_WAIT`] for a
/// lock, and only one maintainer at a time has one. `None`: another
/// maintainer is at it.
async fn turn(
    conn: &mut sqlx::PgConnection,
) -> Result<Option<sqlx::Transaction<'_, sqlx::Postgres>>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    sqlx::query(AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '{LOCK_WAIT}'"
    )))
    .execute(&mut *tx)
    .await?;
    let (turn,): (bool,) =
        sqlx::query_as("SELECT pg_try_advisory_xact_lock(hashtext('idem-postgres maintain'))")
            .fetch_one(&mut *tx)
            .await?;
    Ok(turn.then_some(tx))
}

/// A step that waits for the next maintenance: a lock was not free in
/// time (lock_not_available), or the default partition already holds rows
/// of the period being created (check_violation; they are reaped, and a
/// later period gets its partition).
fn deferred(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    let wait = matches!(db.code().as_deref(), Some("55P03") | Some("23514"));
    if wait {
        tracing::debug!(error = %db, "idem-postgres partition maintenance deferred");
    }
    wait
}
