//! One key, many claimers: 64 tasks, then 4 OS processes, then a process
//! killed mid-body; an exact ledger (rows committed by the bodies) says
//! how many times the body ran.
//!
//! The child processes are this test binary again, running
//! `worker_process` / `doomed_process` with the database in the environment.

use crate::support::{DbStore, TestDb};
use idem_core::{Error, Idempotency, Outcome};
use idem_postgres::{PgStore, RunInTx};
use sqlx::PgPool;
use std::process::Stdio;
use std::time::Duration;

const WORKER_URL: &str = "IDEM_PG_WORKER_URL";

async fn ledger_table(db: &TestDb) {
    db.exec("CREATE TABLE ledger (id bigserial PRIMARY KEY, key text NOT NULL, who text NOT NULL)")
        .await;
}

/// The body: one ledger row, then a pause so that claimers pile up.
async fn body(tx: &mut sqlx::PgConnection, key: &str, who: &str) -> Result<i64, Error> {
    let (id,): (i64,) =
        sqlx::query_as("INSERT INTO ledger (key, who) VALUES ($1, $2) RETURNING id")
            .bind(key)
            .bind(who)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| Error::codec(e.to_string()))?;
    tokio::time::sleep(Duration::from_millis(30)).await;
    Ok(id)
}

/// `n` tasks on one key, half through `run_in_tx`, half through `run`
/// (whose body writes its ledger row on its own connection).
async fn hammer(
    idem: &Idempotency,
    pool: &PgPool,
    key: &'static str,
    who: &str,
    n: usize,
) -> Vec<i64> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let (idem, pool, who) = (idem.clone(), pool.clone(), format!("{who}-{i}"));
        tasks.push(tokio::spawn(async move {
            let call = idem.call("ledger", key).wait(Duration::from_secs(30));
            if i % 2 == 0 {
                call.run_in_tx(&pool, async |tx| body(tx, key, &who).await)
                    .await
            } else {
                call.run(|| async {
                    let mut conn = pool
                        .acquire()
                        .await
                        .map_err(|e| Error::codec(e.to_string()))?;
                    body(&mut conn, key, &who).await
                })
                .await
            }
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_one_execution() {
    let db = TestDb::new().await;
    ledger_table(&db).await;
    let idem = db.builder().await.build();
    for round in ["k1", "k2", "k3"] {
        let values = hammer(&idem, &db.pool, round, "task", 64).await;
        assert_eq!(
            db.count(&format!(
                "SELECT count(*) FROM ledger WHERE key = '{round}'"
            ))
            .await,
            1,
            "{round}"
        );
        assert!(values.iter().all(|v| *v == values[0]), "{values:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_one_execution() {
    let db = TestDb::new().await;
    ledger_table(&db).await;
    db.store().await; // migrated once, before the race
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            tokio::process::Command::new(&exe)
                .args([
                    "--exact",
                    "processes::worker_process",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(WORKER_URL, &db.url)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().await.unwrap();
        assert!(
            out.status.success(),
            "worker failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM ledger WHERE key = 'proc'")
            .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM results").await, 64);
    assert_eq!(db.count("SELECT count(DISTINCT v) FROM results").await, 1);
}

/// Child of `four_processes_one_execution`: 16 tasks on the shared key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process() {
    let Ok(url) = std::env::var(WORKER_URL) else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS results (v bigint)")
        .execute(&pool)
        .await
        .ok();
    let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).build();
    let values = hammer(
        &idem,
        &pool,
        "proc",
        &format!("pid{}", std::process::id()),
        16,
    )
    .await;
    for v in values {
        sqlx::query("INSERT INTO results VALUES ($1)")
            .bind(v)
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_process_leaves_nothing_and_is_taken_over() {
    let db = TestDb::new().await;
    ledger_table(&db).await;
    db.exec("CREATE TABLE progress (what text)").await;
    let idem = db.builder().await.lease(Duration::from_millis(800)).build();
    let exe = std::env::current_exe().unwrap();
    let mut child = tokio::process::Command::new(&exe)
        .args([
            "--exact",
            "processes::doomed_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WORKER_URL, &db.url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while db.count("SELECT count(*) FROM progress").await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never reached its body"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().await.unwrap(); // SIGKILL mid-body, its insert not committed
    // the dead holder's key answers InProgress until its lease runs out …
    let r = idem
        .call("ledger", "doomed")
        .run_in_tx(&db.pool, async |tx| body(tx, "doomed", "parent").await)
        .await;
    assert!(matches!(r, Err(Error::InProgress { .. })), "{r:?}");
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 0);
    // … then it is taken over, and only the new holder's row exists
    tokio::time::sleep(Duration::from_millis(900)).await;
    let (_, o) = idem
        .call("ledger", "doomed")
        .run_in_tx_outcome(&db.pool, async |tx| body(tx, "doomed", "parent").await)
        .await
        .unwrap();
    assert_eq!(o, Outcome::Recovered);
    assert_eq!(
        db.count("SELECT count(*) FROM ledger WHERE who = 'parent'")
            .await,
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 1);
}

/// Child of `killed_process_leaves_nothing_and_is_taken_over`: claims, writes
/// its ledger row in the transaction, says so, and hangs until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doomed_process() {
    let Ok(url) = std::env::var(WORKER_URL) else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let idem = Idempotency::builder(PgStore::from_pool(pool.clone()))
        .lease(Duration::from_millis(800))
        .build();
    let progress = pool.clone();
    let _: Result<i64, Error> = idem
        .call("ledger", "doomed")
        .run_in_tx(&pool, async |tx| {
            body(tx, "doomed", "child").await?;
            sqlx::query("INSERT INTO progress VALUES ('inserted')")
                .execute(&progress)
                .await
                .unwrap();
            std::future::pending::<()>().await;
            Ok(0)
        })
        .await;
}
