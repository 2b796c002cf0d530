//! A fresh PostgreSQL database per test on the server at 127.0.0.1:5432
//! (or `IDEM_PG_URL`), dropped afterwards.
#![allow(dead_code)]

use idem_core::{Idempotency, IdempotencyBuilder};
use idem_postgres::PgStore;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The maintenance database URL tests create their databases through.
pub fn admin_url() -> String {
    std::env::var("IDEM_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn with_db(url: &str, db: &str) -> String {
    match url.rfind('/') {
        Some(i) if url[..i].contains("://") && url[..i].rfind('/') != Some(i - 1) => {
            format!("{}/{db}", &url[..i])
        }
        _ => format!("{url}/{db}"),
    }
}

/// One test's database; dropped (with its connections) when this is.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new() -> TestDb {
        static N: AtomicU32 = AtomicU32::new(0);
        let admin = admin_url();
        let name = format!(
            "idem_test_{}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            rand_suffix()
        );
        let mut conn = match sqlx::PgConnection::connect_with_url(&admin).await {
            Ok(c) => c,
            Err(e) => panic!(
                "PostgreSQL is not reachable at {admin} ({e}). These tests need a server on \
                 127.0.0.1:5432 with trust auth for user `postgres` (`.ci/run` installs and starts \
                 one), or set IDEM_PG_URL."
            ),
        };
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));
        let url = with_db(&admin, &name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test database {url}: {e}"));
        TestDb { name, url, pool }
    }

    /// A migrated store over this database's pool.
    pub async fn store(&self) -> PgStore {
        let store = PgStore::from_pool(self.pool.clone());
        store.migrate().await.expect("migrate");
        store
    }

    pub async fn builder(&self) -> IdempotencyBuilder {
        Idempotency::builder(self.store().await)
    }

    /// Runs SQL that returns nothing.
    pub async fn exec(&self, sql: &str) {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    pub async fn count(&self, sql: &str) -> i64 {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        n
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (admin, name) = (admin_url(), self.name.clone());
        // Drop runs inside the test's runtime: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = sqlx::PgConnection::connect_with_url(&admin).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
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

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish() % 1_000_000
}

trait ConnectUrl: Sized {
    async fn connect_with_url(url: &str) -> Result<Self, sqlx::Error>;
}

impl ConnectUrl for sqlx::PgConnection {
    async fn connect_with_url(url: &str) -> Result<Self, sqlx::Error> {
        use sqlx::Connection;
        sqlx::PgConnection::connect(url).await
    }
}
