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

/// A private PostgreSQL server (`initdb` + `pg_ctl`) on a free port of
/// 127.0.0.1, trust auth for user `postgres`, files in a temporary
/// directory; for tests that stop, kill or restart the server. Run as the
/// `postgres` OS user when the tests run as root (PostgreSQL refuses root).
/// Stopped (immediately) and deleted on drop.
///
/// ```no_run
/// let mut pg = idem_testkit::PgServer::start();
/// let url = pg.url("postgres");
/// pg.restart();
/// ```
#[derive(Debug)]
pub struct PgServer {
    dir: tempfile::TempDir,
    port: u16,
}

impl PgServer {
    /// Initializes and starts a server.
    ///
    /// # Panics
    ///
    /// When `initdb` or `pg_ctl` is missing (install `postgresql`; on Debian
    /// they live in `/usr/lib/postgresql/<version>/bin`) or the server does
    /// not start; the message carries the server log.
    pub fn start() -> PgServer {
        let dir = tempfile::Builder::new()
            .prefix("idem-pg-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temporary directory: {e}"));
        let port = crate::free_port();
        let server = PgServer { dir, port };
        if is_root() {
            // The server's files must belong to the user it runs as.
            run_checked("chown", &["-R", "postgres", &server.path()]);
        }
        server.as_owner(&format!(
            "{} -D '{}/data' -U postgres --auth=trust --no-sync >'{}/initdb.log' 2>&1",
            pg_bin("initdb"),
            server.path(),
            server.path()
        ));
        server.start_again();
        server
    }

    /// A URL for database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: like a crash,
    /// no checkpoint; every connection is cut).
    pub fn stop(&self) {
        self.as_owner(&format!(
            "{} -D '{}/data' -m immediate -w stop >/dev/null 2>&1",
            pg_bin("pg_ctl"),
            self.path()
        ));
    }

    /// Starts the stopped server again on the same port, with its data.
    pub fn start_again(&self) {
        self.as_owner(&format!(
            "{} -D '{p}/data' -l '{p}/server.log' -w -t 30 -o \"-h 127.0.0.1 -p {port} -k '{p}' -c fsync=off\" start >/dev/null 2>&1",
            pg_bin("pg_ctl"),
            p = self.path(),
            port = self.port
        ));
    }

    /// Stops (immediately) and starts again.
    pub fn restart(&self) {
        self.stop();
        self.start_again();
    }

    fn path(&self) -> String {
        self.dir.path().display().to_string()
    }

    fn as_owner(&self, script: &str) {
        let status = if is_root() {
            std::process::Command::new("su")
                .args(["postgres", "-s", "/bin/sh", "-c", script])
                .status()
        } else {
            std::process::Command::new("sh")
                .args(["-c", script])
                .status()
        };
        match status {
            Ok(s) if s.success() => {}
            other => {
                let log = std::fs::read_to_string(self.dir.path().join("server.log"))
                    .or_else(|_| std::fs::read_to_string(self.dir.path().join("initdb.log")))
                    .unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                panic!(
                    "`{script}` failed ({other:?}). PostgreSQL's initdb and pg_ctl must be \
                     installed (apt-get install postgresql){}. Log:\n{tail}",
                    if is_root() {
                        ", and a `postgres` OS user must exist"
                    } else {
                        ""
                    }
                );
            }
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let script = format!(
            "{} -D '{}/data' -m immediate stop >/dev/null 2>&1",
            pg_bin("pg_ctl"),
            self.path()
        );
        let _ = if is_root() {
            std::process::Command::new("su")
                .args(["postgres", "-s", "/bin/sh", "-c", &script])
                .status()
        } else {
            std::process::Command::new("sh")
                .args(["-c", &script])
                .status()
        };
    }
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `name` on PATH, else the newest `/usr/lib/postgresql/*/bin/name`.
fn pg_bin(name: &str) -> String {
    let on_path = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    if let Some(p) = on_path.filter(|p| !p.is_empty()) {
        return p;
    }
    let mut versions: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    versions.sort();
    versions
        .last()
        .map(|v| v.join("bin").join(name).display().to_string())
        .unwrap_or_else(|| name.to_owned())
}

fn run_checked(cmd: &str, args: &[&str]) {
    match std::process::Command::new(cmd).args(args).status() {
        Ok(s) if s.success() => {}
        other => panic!("`{cmd} {}` failed: {other:?}", args.join(" ")),
    }
}
