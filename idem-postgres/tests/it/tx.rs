//! `run_in_tx`: the body's rows and the stored result commit or roll back
//! together — on success, `Err`, panic, cancellation, a lost lease and a
//! serialization conflict.

use crate::support::{DbStore, TestDb};
use idem_core::{Error, Idempotency, MemoryStore, Outcome};
use idem_postgres::{PgStore, RunInTx};
use sqlx::PgConnection;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

async fn setup() -> (TestDb, Idempotency) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL, holder text)")
        .await;
    let idem = db.builder().await.namespace("t").build();
    (db, idem)
}

async fn insert(tx: &mut PgConnection, req: &str, holder: &str) -> Result<i64, Error> {
    let (id,): (i64,) =
        sqlx::query_as("INSERT INTO orders (req, holder) VALUES ($1, $2) RETURNING id")
            .bind(req)
            .bind(holder)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| Error::codec(format!("insert: {e}")))?;
    Ok(id)
}

async fn orders(db: &TestDb, req: &str) -> i64 {
    db.count(&format!("SELECT count(*) FROM orders WHERE req = '{req}'"))
        .await
}

async fn records(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM idem_keys").await
}

fn assert_send<T: Send>(t: T) -> T {
    t
}

#[tokio::test]
async fn success_commits_rows_and_result_together_and_replays() {
    let (db, idem) = setup().await;
    let runs = AtomicUsize::new(0);
    let pool = db.pool.clone();
    // the future is Send, so it can run in axum handlers and spawned tasks
    let (id, o) = assert_send(
        idem.call("orders.create", "r1")
            .fingerprint(&500)
            .run_in_tx_outcome(&pool, async |tx| {
                runs.fetch_add(1, Ordering::SeqCst);
                insert(tx, "r1", "a").await
            }),
    )
    .await
    .unwrap();
    assert_eq!(o, Outcome::Executed);
    assert_eq!(
        (
            orders(&db, "r1").await,
            db.count("SELECT count(*) FROM idem_keys WHERE state = 'C' AND NOT in_tx")
                .await
        ),
        (1, 1)
    );
    let (again, o) = idem
        .call("orders.create", "r1")
        .fingerprint(&500)
        .run_in_tx_outcome(&pool, async |tx| insert(tx, "r1", "b").await)
        .await
        .unwrap();
    assert_eq!((again, o), (id, Outcome::Replayed));
    let e = idem
        .call("orders.create", "r1")
        .fingerprint(&501)
        .run_in_tx(&pool, async |tx| insert(tx, "r1", "c").await)
        .await;
    assert!(matches!(e, Err(Error::FingerprintMismatch)), "{e:?}");
    // and a plain call replays the same stored result
    let plain: i64 = idem
        .call("orders.create", "r1")
        .run(|| async { Ok::<_, Error>(-1) })
        .await
        .unwrap();
    assert_eq!(
        (plain, orders(&db, "r1").await, runs.load(Ordering::SeqCst)),
        (id, 1, 1)
    );
}

#[tokio::test]
async fn err_rolls_back_and_releases() {
    let (db, idem) = setup().await;
    let r: Result<i64, Error> = idem
        .call("orders.create", "r2")
        .run_in_tx(&db.pool, async |tx| {
            insert(tx, "r2", "a").await?;
            Err(Error::codec("declined"))
        })
        .await;
    assert!(matches!(r, Err(Error::Codec { .. })));
    assert_eq!((orders(&db, "r2").await, records(&db).await), (0, 0));
    // released: the retry runs and commits
    let (_, o) = idem
        .call("orders.create", "r2")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r2", "b").await)
        .await
        .unwrap();
    assert_eq!((o, orders(&db, "r2").await), (Outcome::Executed, 1));
}

#[tokio::test]
async fn panic_rolls_back_and_releases() {
    let (db, idem) = setup().await;
    let pool = db.pool.clone();
    let idem2 = idem.clone();
    let joined = tokio::spawn(async move {
        let _: Result<i64, Error> = idem2
            .call("orders.create", "r3")
            .run_in_tx(&pool, async |tx| {
                insert(tx, "r3", "a").await?;
                panic!("body panics after its insert");
            })
            .await;
    })
    .await;
    assert!(joined.unwrap_err().is_panic());
    assert_eq!(orders(&db, "r3").await, 0);
    let (_, o) = idem
        .call("orders.create", "r3")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r3", "b").await)
        .await
        .unwrap();
    assert_eq!((o, orders(&db, "r3").await), (Outcome::Executed, 1));
}

#[tokio::test]
async fn cancellation_rolls_back_and_releases() {
    let (db, idem) = setup().await;
    let (inserted_tx, inserted) = oneshot::channel::<()>();
    let fut = idem
        .call("orders.create", "r4")
        .run_in_tx(&db.pool, async |tx| {
            insert(tx, "r4", "a").await?;
            let _ = inserted_tx.send(());
            std::future::pending::<()>().await;
            Ok::<_, Error>(0i64)
        });
    tokio::select! {
        _ = fut => unreachable!(),
        _ = inserted => {} // dropped here, mid-body, after its insert
    }
    // the release runs in a task of its own: wait for the key to free up
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while records(&db).await != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "key not released after cancellation"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(orders(&db, "r4").await, 0);
    let (_, o) = idem
        .call("orders.create", "r4")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r4", "b").await)
        .await
        .unwrap();
    assert_eq!((o, orders(&db, "r4").await), (Outcome::Executed, 1));
}

#[tokio::test]
async fn lost_lease_commits_nothing_of_the_old_holder() {
    let (db, idem) = setup().await;
    let (go_tx, go) = oneshot::channel::<()>();
    let (inserted_tx, inserted) = oneshot::channel::<()>();
    let old = {
        let (idem, pool) = (idem.clone(), db.pool.clone());
        tokio::spawn(async move {
            idem.call("orders.create", "r5")
                .run_in_tx_outcome(&pool, async |tx| {
                    let id = insert(tx, "r5", "old").await?;
                    let _ = inserted_tx.send(());
                    let _ = go.await;
                    Ok::<_, Error>(id)
                })
                .await
        })
    };
    inserted.await.unwrap();
    // the old holder's lease runs out (as if it had been frozen): a new holder takes over
    db.exec("UPDATE idem_keys SET lease_until = clock_timestamp() - interval '1 second'")
        .await;
    let (new_id, o) = idem
        .call("orders.create", "r5")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r5", "new").await)
        .await
        .unwrap();
    assert_eq!(o, Outcome::Recovered);
    go_tx.send(()).unwrap();
    let r = old.await.unwrap();
    assert!(matches!(r, Err(Error::LeaseLost)), "{r:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM orders WHERE holder = 'old'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM orders WHERE holder = 'new'")
            .await,
        1
    );
    let (v, o) = idem
        .call("orders.create", "r5")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r5", "x").await)
        .await
        .unwrap();
    assert_eq!((v, o), (new_id, Outcome::Replayed));
}

#[tokio::test]
async fn serialization_failure_is_a_retryable_conflict() {
    let (db, idem) = setup().await;
    let (read_tx, read) = oneshot::channel::<()>();
    let (go_tx, go) = oneshot::channel::<()>();
    let call = {
        let (idem, pool) = (idem.clone(), db.pool.clone());
        tokio::spawn(async move {
            idem.call("orders.create", "r6")
                .run_in_tx(&pool, async |tx| {
                    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    let id = insert(tx, "r6", "a").await?;
                    let _ = read_tx.send(());
                    let _ = go.await;
                    Ok::<_, Error>(id)
                })
                .await
        })
    };
    read.await.unwrap();
    // a concurrent write to the record after the body's snapshot (as a lease renewal is)
    db.exec("UPDATE idem_keys SET lease_until = lease_until + interval '1 second'")
        .await;
    go_tx.send(()).unwrap();
    let r = call.await.unwrap();
    match &r {
        Err(e @ Error::Conflict { code, .. }) => assert!(code == "40001" && e.is_retryable()),
        other => panic!("{other:?}"),
    }
    assert_eq!((orders(&db, "r6").await, records(&db).await), (0, 0));
    let (_, o) = idem
        .call("orders.create", "r6")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r6", "b").await)
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
}

#[tokio::test]
async fn in_progress_duplicates_and_wait() {
    let (db, idem) = setup().await;
    let (inserted_tx, inserted) = oneshot::channel::<()>();
    let (go_tx, go) = oneshot::channel::<()>();
    let first = {
        let (idem, pool) = (idem.clone(), db.pool.clone());
        tokio::spawn(async move {
            idem.call("orders.create", "r7")
                .run_in_tx(&pool, async |tx| {
                    let id = insert(tx, "r7", "a").await?;
                    let _ = inserted_tx.send(());
                    let _ = go.await;
                    Ok::<_, Error>(id)
                })
                .await
        })
    };
    inserted.await.unwrap();
    let dup = idem
        .call("orders.create", "r7")
        .run_in_tx(&db.pool, async |tx| insert(tx, "r7", "b").await)
        .await;
    assert!(matches!(dup, Err(Error::InProgress { .. })), "{dup:?}");
    let waiter = {
        let (idem, pool) = (idem.clone(), db.pool.clone());
        tokio::spawn(async move {
            idem.call("orders.create", "r7")
                .wait(Duration::from_secs(10))
                .run_in_tx(&pool, async |tx| insert(tx, "r7", "c").await)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    go_tx.send(()).unwrap();
    let id = first.await.unwrap().unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), id);
    assert_eq!(orders(&db, "r7").await, 1);
}

#[tokio::test]
async fn over_another_store_is_refused_before_the_body() {
    let db = TestDb::new().await;
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = idem
        .call("s", "k")
        .run_in_tx(&db.pool, async |_tx| {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(1)
        })
        .await;
    assert!(matches!(r, Err(Error::InvalidConfig(_))), "{r:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // and a body whose transaction was aborted cannot commit anything
    let idem = db.builder().await.build();
    db.exec("CREATE TABLE t (x int)").await;
    let r = idem
        .call("s", "aborted")
        .run_in_tx(&db.pool, async |tx| {
            sqlx::query("INSERT INTO t VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            let _ = sqlx::query("SELECT 1/0").execute(&mut *tx).await; // swallowed error
            Ok::<_, Error>(1)
        })
        .await;
    assert!(
        matches!(r, Err(Error::Unavailable { op: "commit", .. })),
        "{r:?}"
    );
    assert_eq!(
        (
            db.count("SELECT count(*) FROM t").await,
            db.count("SELECT count(*) FROM idem_keys").await
        ),
        (0, 0)
    );
    let _ = PgStore::from_pool(db.pool.clone());
}

#[tokio::test]
async fn fail_open_with_the_store_down_commits_the_body_alone() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL, holder text)")
        .await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dead = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/x"))
        .unwrap();
    let open = Idempotency::builder(PgStore::from_pool(dead.clone()))
        .fail_mode(idem_core::FailMode::Open)
        .build();
    let (_, o) = open
        .call("orders.create", "r8")
        .run_in_tx_outcome(&db.pool, async |tx| insert(tx, "r8", "a").await)
        .await
        .unwrap();
    assert_eq!((o, orders(&db, "r8").await), (Outcome::Unprotected, 1));
    let closed = Idempotency::builder(PgStore::from_pool(dead)).build();
    let r = closed
        .call("orders.create", "r9")
        .run_in_tx(&db.pool, async |tx| insert(tx, "r9", "a").await)
        .await;
    assert!(
        matches!(r, Err(Error::Unavailable { op: "claim", .. })),
        "{r:?}"
    );
    assert_eq!(orders(&db, "r9").await, 0);
}

#[tokio::test]
async fn statement_timeout_is_unavailable() {
    let (db, _) = setup().await;
    db.exec(&format!(
        "ALTER DATABASE \"{}\" SET statement_timeout = '200ms'",
        db.name
    ))
    .await;
    // new connections pick the setting up
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect(&db.url)
        .await
        .unwrap();
    let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).build();
    // an expired record, locked by a transaction that does not finish: the
    // claim's takeover waits on the lock until the timeout
    db.exec("INSERT INTO idem_keys (key, state, expires_at) VALUES ('idem:s:k', 'C', clock_timestamp() - interval '1 second')")
        .await;
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idem_keys WHERE key = 'idem:s:k' FOR UPDATE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let r: Result<u32, Error> = idem
        .call("s", "k")
        .run(|| async { panic!("must not run") })
        .await;
    match &r {
        Err(
            e @ Error::Unavailable {
                op: "claim",
                reason,
                ..
            },
        ) => {
            assert!(reason.contains("statement_timeout"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    locker.rollback().await.unwrap();
    let v: u32 = idem
        .call("s", "k")
        .run(|| async { Ok::<_, Error>(4) })
        .await
        .unwrap();
    assert_eq!(v, 4);
}

/// A pool on `db` that counts the connections given back to it.
async fn counting_pool(db: &TestDb, released: &Arc<AtomicUsize>) -> sqlx::PgPool {
    let released = Arc::clone(released);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_release(move |_, _| {
            released.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(true) })
        })
        .connect(&db.url)
        .await
        .unwrap()
}

/// How many connections `pool` has been given back, once every one is back
/// (sqlx gives a connection back in a task of its own).
async fn released_when_idle(pool: &sqlx::PgPool, released: &AtomicUsize) -> usize {
    for _ in 0..1000 {
        if pool.num_idle() == pool.size() as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    released.load(Ordering::SeqCst)
}

#[tokio::test]
async fn the_claim_runs_on_the_connection_the_body_then_uses() {
    let (db, _) = setup().await;
    let released = Arc::new(AtomicUsize::new(0));
    let pool = counting_pool(&db, &released).await;
    let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).build();
    let backend = async |tx: &mut PgConnection| {
        let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| Error::codec(e.to_string()))?;
        Ok::<_, Error>(pid)
    };
    // claim, body and completion: one connection taken from the pool and
    // given back once (sqlx pings it each way), not one per step; and a
    // replay holds no connection past its claim
    for expected in [Outcome::Executed, Outcome::Replayed] {
        let before = released_when_idle(&pool, &released).await;
        let (_, o) = idem
            .call("s", "one-checkout")
            .run_in_tx_outcome(&pool, backend)
            .await
            .unwrap();
        assert_eq!(
            (o, released_when_idle(&pool, &released).await - before),
            (expected, 1)
        );
    }

    // A store over another pool on another database: the claim stays on the
    // store's pool, so the caller's database never holds a record of its own.
    let other = TestDb::new().await;
    let other_store = PgStore::from_pool(other.pool.clone());
    other_store.migrate().await.unwrap();
    let split = Idempotency::builder(other_store).build();
    let before = released_when_idle(&pool, &released).await;
    let r = split
        .call("s", "split")
        .run_in_tx(&pool, async |tx| insert(tx, "split", "a").await)
        .await;
    // the completion runs in the caller's transaction, where the claim is
    // not: nothing commits, and the call says why
    assert!(matches!(r, Err(Error::LeaseLost)), "{r:?}");
    assert_eq!(
        (
            orders(&db, "split").await,
            records(&db).await
                - db.count("SELECT count(*) FROM idem_keys WHERE key LIKE '%one-checkout'")
                    .await,
            released_when_idle(&pool, &released).await - before
        ),
        (0, 0, 1)
    );
}
