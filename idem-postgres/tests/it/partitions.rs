//! Tables partitioned by time (`PgStoreConfig::partitioned`): one live
//! record per key whatever partitions its rows are in, retention by
//! dropping whole partitions (never one a row still lives in, nor one a
//! transaction is still writing to), the outbox beside it, and claims from
//! many tasks and SIGKILLed processes while the periods turn and the
//! partitions are created and dropped under them.
//!
//! The period is one second, so a test crosses several.

use crate::support::TestDb;
use async_trait::async_trait;
use idem_core::outbox::{OutboxMessage, Sink, SinkError};
use idem_core::store::{Claim, ClaimReply, Complete, OperatorStore, Store, Token, ValueKind};
use idem_core::{Error, Idempotency, Outcome};
use idem_postgres::outbox::{self, Relay};
use idem_postgres::{PgStore, PgStoreConfig, RunInTx};
use idem_testkit::claim;
use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECOND: Duration = Duration::from_secs(1);
const WORKER_URL: &str = "IDEM_PG_PARTITION_WORKER_URL";

fn config() -> PgStoreConfig {
    PgStoreConfig::default().partitioned(SECOND)
}

async fn store(db: &TestDb) -> PgStore {
    let store = PgStore::from_pool_with(db.pool.clone(), config()).unwrap();
    store.migrate().await.expect("migrate");
    store
}

/// The partitions of `parent` (the default one included).
async fn partitions(db: &TestDb, parent: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass('{parent}')"
    ))
    .await
}

async fn rows_of(db: &TestDb, key_like: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM idem_keys WHERE key LIKE '{key_like}'"
    ))
    .await
}

/// Waits until the database clock is early in a period, so that what a
/// test does next falls in one period.
async fn start_of_period(db: &TestDb) {
    loop {
        let (frac,): (f64,) = sqlx::query_as(
            "SELECT (extract(epoch FROM clock_timestamp()) - floor(extract(epoch FROM clock_timestamp())))::float8",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if frac < 0.3 {
            return;
        }
        tokio::time::sleep(Duration::from_secs_f64(1.0 - frac + 0.01)).await;
    }
}

#[tokio::test]
async fn a_key_with_rows_in_several_partitions_answers_as_one_record() {
    let db = TestDb::new().await;
    let s = store(&db).await;
    assert!(s.schema_sql().contains("PARTITION BY RANGE (gen)"));
    let (a, b, c) = (Token::random(), Token::random(), Token::random());
    let acquired = |attempt| ClaimReply::Acquired { attempt };

    // A lapsed lease is taken over where its row is, periods later.
    assert_eq!(
        s.claim(claim("held", &a, 200, 60_000, None)).await.unwrap(),
        acquired(1)
    );
    tokio::time::sleep(SECOND + Duration::from_millis(300)).await;
    assert_eq!(
        s.claim(claim("held", &b, 200, 60_000, None)).await.unwrap(),
        acquired(2)
    );
    assert_eq!(rows_of(&db, "held").await, 1);
    s.complete(Complete::new("held", &b, ValueKind::Json, b"2"))
        .await
        .unwrap();

    // An expired record is claimed afresh in the current period; its old
    // row stays (invisible) until its partition goes.
    assert_eq!(
        s.claim(claim("short", &a, 50, 150, None)).await.unwrap(),
        acquired(1)
    );
    s.complete(Complete::new("short", &a, ValueKind::Json, b"\"old\""))
        .await
        .unwrap();
    tokio::time::sleep(SECOND + Duration::from_millis(200)).await;
    assert_eq!(
        s.claim(claim("short", &c, 5_000, 60_000, None))
            .await
            .unwrap(),
        acquired(1)
    );
    assert_eq!(rows_of(&db, "short").await, 2);
    match s
        .claim(claim("short", &a, 5_000, 60_000, None))
        .await
        .unwrap()
    {
        ClaimReply::InProgress { .. } => {}
        other => panic!("{other:?}"),
    }
    let info = s
        .inspect("short", false)
        .await
        .unwrap()
        .expect("the live record");
    assert!(info.ttl_left > Some(Duration::from_secs(50)), "{info:?}");
    s.complete(Complete::new("short", &c, ValueKind::Json, b"\"new\""))
        .await
        .unwrap();
    match s
        .claim(claim("short", &b, 5_000, 60_000, None))
        .await
        .unwrap()
    {
        ClaimReply::Completed(done) => assert_eq!(&done.value[..], b"\"new\""),
        other => panic!("{other:?}"),
    }
    // Forgetting removes every row of the key.
    assert!(s.forget("short", false).await.unwrap().is_some());
    assert_eq!(rows_of(&db, "short").await, 0);
}

#[tokio::test]
async fn past_partitions_go_once_nothing_in_them_lives_and_never_before() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)")
        .await;
    let s = store(&db).await;
    let short = Idempotency::builder(s.clone())
        .namespace("short")
        .lease(Duration::from_millis(200))
        .result_ttl(Duration::from_millis(400))
        .build();
    let long = Idempotency::builder(s.clone()).namespace("long").build();
    let ran = AtomicUsize::new(0);
    let order = |idem: &Idempotency, key: String| {
        let (idem, pool, ran) = (idem.clone(), db.pool.clone(), &ran);
        async move {
            idem.call("orders", &key)
                .run_in_tx(&pool, async |tx| {
                    ran.fetch_add(1, Ordering::SeqCst);
                    sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                        .bind(&key)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| Error::codec(e.to_string()))?;
                    let payload = if key.contains("poison") {
                        "poison"
                    } else {
                        "ok"
                    };
                    outbox::publish(tx, "orders.created", &key, payload).await?;
                    Ok::<_, Error>(key.len())
                })
                .await
                .unwrap()
        }
    };
    // One long-lived record and one message that will be parked, in a
    // period of their own; then short-lived ones in the next.
    // (Maintained first, as a reaper would: the rows go to their period's
    // partition, not the default one.)
    start_of_period(&db).await;
    s.maintain().await.unwrap();
    order(&long, "kept".into()).await;
    order(&long, "poison".into()).await;
    tokio::time::sleep(SECOND).await;
    s.maintain().await.unwrap();
    for i in 0..50 {
        order(&short, format!("s{i}")).await;
    }
    let sink = Arc::new(Recorder::default());
    let relay = Relay::new(&s, Arc::clone(&sink));
    while relay.drain_once().await.unwrap().sent > 0 {}
    assert_eq!(sink.sent.load(Ordering::SeqCst), 51);
    assert_eq!(s.outbox().parked(10).await.unwrap().len(), 1);

    // Where the long-lived record and the parked message are.
    let kept_home = home(&db, "idem_keys", "key LIKE 'long:%kept'").await;
    let parked_home = home(&db, "idem_keys_outbox", "parked_at IS NOT NULL").await;
    // Maintenance, as the reaper's ticks run it (with reaping, for what
    // the default partition took on a slow machine), until the
    // short-lived records are gone.
    let deadline = tokio::time::Instant::now() + 30 * SECOND;
    let mut dropped = 0;
    while rows_of(&db, "short:%").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired records stay"
        );
        tokio::time::sleep(SECOND / 2).await;
        dropped += s.maintain().await.unwrap().dropped;
        s.reap(1000).await.unwrap();
    }
    assert!(dropped >= 1, "whole partitions went");
    // What lives was kept where it was: the record replays, the parked
    // message waits.
    assert_eq!(
        home(&db, "idem_keys", "key LIKE 'long:%kept'").await,
        kept_home
    );
    assert_eq!(order(&long, "kept".into()).await, 4);
    assert_eq!(ran.load(Ordering::SeqCst), 52);
    let parked = s.outbox().parked(10).await.unwrap();
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(
        home(&db, "idem_keys_outbox", "parked_at IS NOT NULL").await,
        parked_home
    );
    // Dropped by the operator, its partition goes at a later maintenance
    // (unless the default partition took it).
    assert!(
        s.outbox()
            .drop_parked(&parked[0].id)
            .await
            .unwrap()
            .is_some()
    );
    if !parked_home.contains("pdefault") {
        let gone =
            format!("SELECT count(*) FROM pg_class WHERE oid = to_regclass('{parked_home}')");
        while db.count(&gone).await > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{parked_home} stays"
            );
            s.maintain().await.unwrap();
            tokio::time::sleep(SECOND / 4).await;
        }
    }
}

/// The partition that holds the row of `table` matching `filter`.
async fn home(db: &TestDb, table: &str, filter: &str) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT tableoid::regclass::text FROM {table} WHERE {filter}"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_partition_a_transaction_still_writes_to_is_never_dropped() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)")
        .await;
    let s = store(&db).await;
    let idem = Idempotency::builder(s.clone()).namespace("slow").build();
    let stop = Arc::new(AtomicBool::new(false));
    // A maintainer as busy as can be (its DROP nearly always waiting for
    // the lock when the transaction commits), beside a body whose transaction
    // outlives its claim's period by three.
    let maintainer = {
        let (s, stop) = (s.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut seen = idem_postgres::Maintenance::default();
            while !stop.load(Ordering::SeqCst) {
                let done = s.maintain().await.expect("maintain");
                seen.dropped += done.dropped;
                seen.deferred += done.deferred;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        })
    };
    let ran = AtomicUsize::new(0);
    for _ in 0..2 {
        let (n, outcome) = idem
            .call("orders", "slow-1")
            .run_in_tx_outcome(&db.pool, async |tx| {
                ran.fetch_add(1, Ordering::SeqCst);
                sqlx::query("INSERT INTO orders (req) VALUES ('slow-1')")
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| Error::codec(e.to_string()))?;
                outbox::publish(tx, "orders.created", "slow-1", "m").await?;
                tokio::time::sleep(3 * SECOND + Duration::from_millis(500)).await;
                Ok::<_, Error>(7u8)
            })
            .await
            .unwrap();
        assert_eq!(n, 7);
        assert!(matches!(outcome, Outcome::Executed | Outcome::Replayed));
    }
    // Past its period now, and still live: kept through more maintenance.
    tokio::time::sleep(SECOND).await;
    stop.store(true, Ordering::SeqCst);
    let seen = maintainer.await.unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1, "{seen:?}");
    assert_eq!(db.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(rows_of(&db, "%slow-1").await, 1);
    assert_eq!(s.outbox().backlog().await.unwrap().pending, 1);
}

#[tokio::test]
async fn concurrent_batches_of_shared_keys_claim_each_key_once() {
    let db = TestDb::new().await;
    let s = store(&db).await;
    let keys: Vec<String> = (0..40).map(|i| format!("b{i}")).collect();
    let won = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let (s, won) = (s.clone(), Arc::clone(&won));
        let mut mine = keys.clone();
        // Each batch in its own order: sorted, reversed, rotated.
        match t % 3 {
            0 => {}
            1 => mine.reverse(),
            _ => {
                let by = (t * 7) as usize % mine.len();
                mine.rotate_left(by)
            }
        }
        tasks.push(tokio::spawn(async move {
            for round in 0..5 {
                let tokens: Vec<Token> = mine.iter().map(|_| Token::random()).collect();
                let claims: Vec<Claim<'_>> = mine
                    .iter()
                    .zip(&tokens)
                    .map(|(k, tok)| claim(k, tok, 30_000, 60_000, None))
                    .collect();
                for (key, reply) in mine.iter().zip(s.claim_batch(&claims).await) {
                    match reply {
                        Ok(ClaimReply::Acquired { .. }) => {
                            *won.lock().unwrap().entry(key.clone()).or_default() += 1
                        }
                        Ok(ClaimReply::InProgress { .. }) => {}
                        other => panic!("task {t} round {round} {key}: {other:?}"),
                    }
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let won = won.lock().unwrap().clone();
    assert_eq!(won.len(), keys.len());
    assert!(won.values().all(|n| *n == 1), "{won:?}");
    for key in &keys {
        assert_eq!(rows_of(&db, key).await, 1, "{key}");
    }
}

#[tokio::test]
async fn without_maintenance_rows_go_to_the_default_partition_and_are_reaped() {
    let db = TestDb::new().await;
    let s = store(&db).await;
    // Past the periods `migrate` made partitions for.
    tokio::time::sleep(5 * SECOND).await;
    let idem = Idempotency::builder(s.clone())
        .namespace("late")
        .lease(Duration::from_millis(100))
        .result_ttl(2 * SECOND)
        .build();
    let ran = AtomicUsize::new(0);
    for i in 0..20 {
        // Each call twice: the second replays, from the default partition.
        for _ in 0..2 {
            let n: u32 = idem
                .call("c", format!("k{i}"))
                .run(|| async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(1)
                })
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
    }
    assert_eq!(ran.load(Ordering::SeqCst), 20);
    assert_eq!(
        db.count("SELECT count(*) FROM idem_keys_pdefault").await,
        20
    );
    tokio::time::sleep(3 * SECOND).await;
    assert_eq!(s.reap(1000).await.unwrap(), 20);
    assert_eq!(db.count("SELECT count(*) FROM idem_keys_pdefault").await, 0);
    // Maintenance catches up: the next periods have partitions again.
    let done = s.maintain().await.unwrap();
    assert!(done.created >= 4, "{done:?}");
}

#[tokio::test]
async fn a_table_of_the_other_layout_is_refused() {
    let db = TestDb::new().await;
    let plain = PgStore::from_pool(db.pool.clone());
    plain.migrate().await.unwrap();
    let e = store_err(PgStore::from_pool_with(db.pool.clone(), config()).unwrap()).await;
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("not partitioned")),
        "{e}"
    );
    let parted = PgStore::from_pool_with(
        db.pool.clone(),
        PgStoreConfig::table("parted").partitioned(SECOND),
    )
    .unwrap();
    parted.migrate().await.unwrap();
    let e = store_err(
        PgStore::from_pool_with(db.pool.clone(), PgStoreConfig::table("parted")).unwrap(),
    )
    .await;
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("is partitioned")),
        "{e}"
    );
    for bad in [
        Duration::ZERO,
        Duration::from_millis(1500),
        Duration::from_secs(40 * 86_400),
    ] {
        let e = PgStore::from_pool_with(db.pool.clone(), PgStoreConfig::default().partitioned(bad))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{bad:?}: {e}");
    }
}

async fn store_err(store: PgStore) -> Error {
    store.migrate().await.expect_err("the other layout")
}

/// Counts what it is sent; refuses payloads saying "poison".
#[derive(Default)]
struct Recorder {
    sent: AtomicUsize,
}

#[async_trait]
impl Sink for Recorder {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        batch
            .iter()
            .map(|m| {
                if m.payload.windows(6).any(|w| w == b"poison") {
                    return Err(SinkError::refused("no such topic"));
                }
                self.sent.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .collect()
    }

    fn describe(&self) -> String {
        "recorder".into()
    }
}

/// Three worker processes claim 240 keys through `run_in_tx` (a ledger row
/// per run, committed with the result), a SIGKILL every half second takes
/// one down mid-body and a new one starts, while a maintainer creates and
/// drops partitions every 100 ms and the periods turn under the claims.
/// Then every key's body has run exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_workers_across_turning_periods_run_each_body_once() {
    const KEYS: usize = 240;
    let db = TestDb::new().await;
    db.exec("CREATE TABLE ledger (id bigserial PRIMARY KEY, key text NOT NULL)")
        .await;
    let s = store(&db).await;
    let stop = Arc::new(AtomicBool::new(false));
    let maintainer = {
        let (s, stop) = (s.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                s.maintain().await.expect("maintain");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let spawn = |n: usize| {
        tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "partitions::worker_process", "--nocapture"])
            .env(WORKER_URL, &db.url)
            .env("IDEM_PG_PARTITION_WORKER_SEED", n.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn a worker")
    };
    let mut workers: Vec<_> = (0..3).map(spawn).collect();
    let mut kills = 0;
    for n in 3..15 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let victim = n % workers.len();
        workers[victim].start_kill().expect("SIGKILL");
        let _ = workers[victim].wait().await;
        kills += 1;
        workers[victim] = spawn(n);
    }
    for mut w in workers {
        let status = w.wait().await.expect("a worker ends");
        assert!(status.success(), "a worker failed: {status}");
    }
    // What the killed ones left undone, done here.
    run_keys(&db.pool, &s, KEYS, 0).await;
    stop.store(true, Ordering::SeqCst);
    maintainer.await.unwrap();
    let runs: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM ledger GROUP BY key ORDER BY key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(runs.len(), KEYS, "every key ran (after {kills} kills)");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "bodies ran more than once: {twice:?}");
    assert!(partitions(&db, "idem_keys").await > 2);
}

/// Runs the 240 keys' calls from `seed`'s offset on, each body adding a
/// ledger row in the call's transaction and pausing up to 40 ms.
async fn run_keys(pool: &sqlx::PgPool, s: &PgStore, keys: usize, seed: usize) {
    let idem = Idempotency::builder(s.clone())
        .namespace("procs")
        .lease(Duration::from_millis(400))
        .build();
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (idem, pool) = (idem.clone(), pool.clone());
            tokio::spawn(async move {
                for i in 0..keys {
                    let key = format!("k{:03}", (i * 7 + t * 31 + seed * 13) % keys);
                    let r = idem
                        .call("ledger", &key)
                        .wait(Duration::from_secs(30))
                        .run_in_tx(&pool, async |tx| {
                            sqlx::query("INSERT INTO ledger (key) VALUES ($1)")
                                .bind(&key)
                                .execute(&mut *tx)
                                .await
                                .map_err(|e| Error::codec(e.to_string()))?;
                            let pause = (i as u64 * 17 + t as u64) % 40;
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                            Ok::<_, Error>(())
                        })
                        .await;
                    r.unwrap_or_else(|e| panic!("{key}: {e}"));
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// A worker: every key, from an offset of its own. Not a test on its own
/// (returns at once without its URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process() {
    let Ok(url) = std::env::var(WORKER_URL) else {
        return;
    };
    let seed: usize = std::env::var("IDEM_PG_PARTITION_WORKER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .expect("connect");
    let s = PgStore::from_pool_with(pool.clone(), config()).unwrap();
    run_keys(&pool, &s, 240, seed).await;
}
