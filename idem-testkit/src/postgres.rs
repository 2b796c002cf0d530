//! A fresh PostgreSQL database per test, on the server at 127.0.0.1:5432
//! (trust auth, user `postgres`; `.ci/run` makes sure one runs) or at
//! `IDEM_PG_URL`, dropped when the test is done.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The maintenance database tests create theirs through: `IDEM_PG_URL`, or
/// `postgres://postgres@127.0.0.1:5432/postgres`.
///
/// ```
/// assert!(idem_testkit::pg_admin_url().starts_with("postgres"));
/// ```
pub fn pg_admin_url() -> String {
    std::env::var("IDEM_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// One test's own database (`idem_test_<pid>_<n>_<r>`) and a pool on it;
/// dropping it drops the database, closing whatever is still connected.
///
/// ```no_run
/// # async fn demo() {
/// let db = idem_testkit::PgTestDb::new().await;
/// db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY)").await;
/// assert_eq!(db.count("SELECT count(*) FROM orders").await, 0);
/// # }
/// ```
#[derive(Debug)]
pub struct PgTestDb {
    /// The database's name.
    pub name: String,
    /// A URL that connects to it.
    pub url: String,
    /// A pool on it (20 connections).
    pub pool: PgPool,
}

impl PgTestDb {
    /// Creates the database.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached, saying how to provide one.
    pub async fn new() -> PgTestDb {
        static N: AtomicU32 = AtomicU32::new(0);
        let admin = pg_admin_url();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "idem_test_{}_{}_{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {admin} ({e}). These tests need a server on \
                 127.0.0.1:5432 with trust auth for user `postgres` (`.ci/run` installs and \
                 starts one), or IDEM_PG_URL pointing at another"
            )
        });
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));
        let url = match admin.rfind('/') {
            Some(i) if admin[..i].ends_with(|c: char| c != '/') && admin[..i].contains("://") => {
                format!("{}/{name}", &admin[..i])
            }
            _ => format!("{admin}/{name}"),
        };
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"));
        PgTestDb { name, url, pool }
    }

    /// Runs a statement that returns nothing.
    ///
    /// # Panics
    ///
    /// When it fails.
    pub async fn exec(&self, sql: &str) {
        sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Runs a query returning one `bigint` (`SELECT count(*) …`).
    ///
    /// # Panics
    ///
    /// When it fails.
    pub async fn count(&self, sql: &str) -> i64 {
        let (n,): (i64,) = sqlx::query_as(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        n
    }
}

impl Drop for PgTestDb {
    fn drop(&mut self) {
        let (admin, name) = (pg_admin_url(), self.name.clone());
        // Drop may run inside the test's runtime: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&admin).await {
                    let _ = sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}
