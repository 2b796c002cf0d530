//! From driver errors to `idem_core::Error`, with messages that say what to do.

use idem_core::Error;

/// Maps a sqlx error met during `op`. Connection-level failures become
/// [`Error::Unavailable`] (so `FailMode` applies); conflicts become
/// [`Error::Conflict`]; a missing table or privilege becomes
/// [`Error::InvalidConfig`], since retrying cannot fix it.
pub(crate) fn map(op: &'static str, table: &str, e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e {
        let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
        let msg = db.message().to_owned();
        // The driver's error stays reachable through `source()`.
        let mapped = match code.as_str() {
            "40001" | "40P01" => Error::Conflict { code, reason: msg },
            // undefined_table
            "42P01" | "3F000" => Error::InvalidConfig(format!(
                "table {table} does not exist ({msg}); run `PgStore::migrate()` once, or apply \
                 idem-postgres/schema.sql with your migrations"
            )),
            // undefined_function: a table migrated by an older idem-postgres
            "42883" => Error::InvalidConfig(format!(
                "a function of table {table} is missing ({msg}): idem-postgres writes through \
                 functions installed beside its table; run `PgStore::migrate()` again, or apply \
                 this version's idem-postgres/schema.sql with your migrations"
            )),
            // insufficient_privilege
            "42501" => Error::InvalidConfig(format!(
                "the database user may not use table {table} ({msg}); grant SELECT, INSERT, \
                 UPDATE and DELETE on it, and EXECUTE on its functions"
            )),
            // undefined_column, datatype_mismatch: a table of another shape
            "42703" | "42804" => Error::InvalidConfig(format!(
                "table {table} does not have idem's columns ({msg}); it was not created by \
                 idem-postgres — configure another name with `PgStoreConfig::table(..)`"
            )),
            "57014" => unavailable(
                op,
                format!(
                    "the statement was cancelled or hit statement_timeout ({msg}); check for \
                     long-held locks on table {table}, or raise statement_timeout for idem's role"
                ),
            ),
            _ => unavailable(
                op,
                format!(
                    "PostgreSQL refused the statement: {msg} (SQLSTATE {code}); check the \
                     server's log and that table {table} was created by idem-postgres"
                ),
            ),
        };
        return mapped.with_source(e);
    }
    let reason = match &e {
        sqlx::Error::PoolTimedOut => "no connection became free in time: the pool is exhausted or \
            PostgreSQL does not answer; check the server, or raise the pool's max_connections"
            .to_owned(),
        sqlx::Error::PoolClosed => "the connection pool was closed".to_owned(),
        other => format!("{other}; check that PostgreSQL is up and reachable and the URL is right"),
    };
    unavailable(op, reason).with_source(e)
}

/// Maps a sqlx error met on the failure counts' table `failures`: a
/// missing one is a table migrated by an older idem-postgres.
pub(crate) fn map_failures(op: &'static str, failures: &str, e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e
        && db.code().as_deref() == Some("42P01")
    {
        return Error::InvalidConfig(format!(
            "table {failures}, which keeps each key's count of failed runs, does not exist \
             ({}): the table was migrated by an older idem-postgres; run \
             `PgStore::migrate()` again, or apply this version's idem-postgres/schema.sql \
             with your migrations",
            db.message()
        ));
    }
    map(op, failures, e)
}

pub(crate) fn unavailable(op: &'static str, reason: impl Into<String>) -> Error {
    Error::unavailable(op, format!("PostgreSQL: {}", reason.into()))
}
