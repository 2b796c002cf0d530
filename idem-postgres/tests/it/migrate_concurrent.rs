//! Several processes starting at once on a fresh database each run
//! `PgStore::migrate()`: every one succeeds, the schema is made once, and
//! each process can call through it right after.
//!
//! The processes are this test binary again (`migrating_process`), each
//! with its own runtime and pool, all released at one wall-clock instant;
//! each reports when its `migrate()` started and ended, so the test also
//! checks that the migrations did overlap. Each round is a database of its
//! own, created and dropped by the test: plain tables, then partitioned.

use idem_core::{Error, Idempotency};
use idem_postgres::{PgStore, PgStoreConfig, RunInTx};
use idem_testkit::{PgTestDb, unix_ms};
use std::time::Duration;

const URL: &str = "IDEM_PG_MIGRATE_URL";
const START_AT: &str = "IDEM_PG_MIGRATE_START_AT";
const PARTITIONED: &str = "IDEM_PG_MIGRATE_PARTITIONED";
const PROCESSES: usize = 6;

fn config(partitioned: bool) -> PgStoreConfig {
    let config = PgStoreConfig::default();
    if partitioned {
        config.partitioned(Duration::from_secs(3600))
    } else {
        config
    }
}

/// One migration as a child process saw it.
#[derive(Debug)]
struct Report {
    started: u128,
    ended: u128,
    result: String,
}

/// Starts `PROCESSES` children on `db` released together, and collects
/// what each reported.
async fn migrate_at_once(db: &PgTestDb, partitioned: bool) -> Vec<Report> {
    let exe = std::env::current_exe().expect("the test binary");
    // Far enough ahead for every child to start and connect first.
    let start_at = unix_ms() + 2_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            tokio::process::Command::new(&exe)
                .args([
                    "--exact",
                    "migrate_concurrent::migrating_process",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(URL, &db.url)
                .env(START_AT, start_at.to_string())
                .env(PARTITIONED, if partitioned { "1" } else { "0" })
                .kill_on_drop(true)
                .output()
        })
        .collect();
    let mut reports = Vec::new();
    for child in children {
        let out = child.await.expect("a child process");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            // libtest prints `test migrating_process ... ` before it.
            .find_map(|l| l.split_once("MIGRATED ").map(|(_, r)| r))
            .unwrap_or_else(|| {
                panic!(
                    "a child reported nothing (status {}): {stdout}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        let mut parts = line.splitn(3, ' ');
        let mut next = || parts.next().unwrap_or_default().to_owned();
        let (started, ended, result) = (next(), next(), next());
        reports.push(Report {
            started: started.parse().expect("start time"),
            ended: ended.parse().expect("end time"),
            result,
        });
        assert!(
            out.status.success(),
            "a child failed ({}): {line}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    reports
}

/// The objects of the `public` schema, partitions aside, by kind and name.
async fn schema(db: &PgTestDb) -> Vec<String> {
    let sql = "SELECT kind || ' ' || name FROM ( \
                 SELECT CASE c.relkind WHEN 'i' THEN 'index' WHEN 'I' THEN 'index' \
                        ELSE 'table' END AS kind, c.relname::text AS name \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = 'public' AND NOT c.relispartition \
                   AND c.relkind IN ('r', 'p', 'i', 'I', 'S') \
                 UNION ALL SELECT 'function', p.proname::text FROM pg_proc p \
                 JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public' \
                 UNION ALL SELECT 'trigger', t.tgname::text FROM pg_trigger t WHERE NOT t.tgisinternal \
               ) o ORDER BY 1";
    sqlx::query_scalar(sql)
        .fetch_all(&db.pool)
        .await
        .expect("the schema's objects")
}

async fn check_round(partitioned: bool) {
    let db = PgTestDb::new().await;
    let reports = migrate_at_once(&db, partitioned).await;
    for r in &reports {
        assert_eq!(r.result, "ok", "{reports:?}");
    }
    // They ran at once: at least half of them started before the first
    // one was done (all of them, in practice).
    let first_end = reports.iter().map(|r| r.ended).min().unwrap_or(0);
    let first_start = reports.iter().map(|r| r.started).min().unwrap_or(0);
    eprintln!(
        "migrations (ms after the first start): {:?}",
        reports
            .iter()
            .map(|r| (r.started - first_start, r.ended - first_start))
            .collect::<Vec<_>>()
    );
    let overlapping = reports.iter().filter(|r| r.started < first_end).count();
    assert!(
        overlapping * 2 >= PROCESSES,
        "the migrations did not overlap: {reports:?}"
    );

    // The schema is exactly what one process alone makes: the same tables,
    // indexes, functions and triggers (partitions aside: their names follow
    // the clock).
    let reference = PgTestDb::new().await;
    PgStore::from_pool_with(reference.pool.clone(), config(partitioned))
        .expect("config")
        .migrate()
        .await
        .expect("a lone migrate");
    let (made, alone) = (schema(&db).await, schema(&reference).await);
    assert!(
        made.contains(&"table idem_keys_outbox".to_owned()),
        "{made:?}"
    );
    assert_eq!(made, alone, "the concurrent migrations made another schema");
    // Every child made one call through it; a later process migrates
    // without change and calls too.
    assert_eq!(
        db.count("SELECT count(*) FROM idem_keys WHERE state = 'C'")
            .await,
        i64::try_from(PROCESSES).unwrap_or(0)
    );
    let store = PgStore::from_pool_with(db.pool.clone(), config(partitioned)).expect("config");
    store.migrate().await.expect("migrate again");
    let idem = Idempotency::builder(store).build();
    let v: Result<u32, Error> = idem
        .call("after", "k")
        .run_in_tx(&db.pool, async |_tx| Ok(7))
        .await;
    assert_eq!(v.expect("a call after the migrations"), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_processes_migrate_a_fresh_database_at_once() {
    for _ in 0..3 {
        check_round(false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_processes_migrate_a_fresh_partitioned_database_at_once() {
    for _ in 0..2 {
        check_round(true).await;
    }
}

/// Child of the tests above: connects, waits for the common start, runs
/// `migrate()`, reports `MIGRATED <start ms> <end ms> <ok|error>`, then
/// makes one call through the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_process() {
    let Ok(url) = std::env::var(URL) else {
        return;
    };
    let start_at: u128 = std::env::var(START_AT)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("the start time");
    let partitioned = std::env::var(PARTITIONED).is_ok_and(|v| v == "1");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect");
    let store = PgStore::from_pool_with(pool.clone(), config(partitioned)).expect("config");
    let now = unix_ms();
    if start_at > now {
        let wait = u64::try_from(start_at - now).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
    let started = unix_ms();
    let result = store.migrate().await;
    let ended = unix_ms();
    let said = match &result {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("error: {e}"),
    };
    println!("MIGRATED {started} {ended} {said}");
    result.expect("migrate");
    let idem = Idempotency::builder(store).build();
    let key = format!("process-{}", std::process::id());
    let v: Result<u32, Error> = idem.call("first", &key).run(|| async { Ok(1) }).await;
    assert_eq!(v.expect("a call after migrate"), 1);
}
