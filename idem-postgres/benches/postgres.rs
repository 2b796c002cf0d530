//! PgStore against the SQL floor of issue 10, measured in the same run, on
//! the same pool, interleaved so that machine drift hits every phase alike.
//!
//! ```text
//! cargo bench -p idem-postgres --bench postgres                     # 127.0.0.1:5432, 6 s per phase
//! cargo bench -p idem-postgres --bench postgres -- --seconds 2 --concurrency 16
//! IDEM_PG_URL=postgres://user@host/postgres cargo bench -p idem-postgres --bench postgres
//! ```
//!
//! Floors: a fresh call against one `INSERT … ON CONFLICT DO NOTHING` plus
//! one `UPDATE` by primary key; a replay against one `SELECT` by primary
//! key; `run_in_tx` against the body's own transaction (`BEGIN`, the
//! body's `INSERT`, `COMMIT`). The bench creates a database of its own and
//! drops it at the end.

use idem_core::{Error, Idempotency};
use idem_postgres::{PgStore, RunInTx};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    FloorFresh,
    IdemFresh,
    FloorReplay,
    IdemReplay,
    FloorTx,
    IdemTx,
}

const PHASES: [Phase; 6] = [
    Phase::FloorFresh,
    Phase::IdemFresh,
    Phase::FloorReplay,
    Phase::IdemReplay,
    Phase::FloorTx,
    Phase::IdemTx,
];

const REPLAY_KEYS: u64 = 1000;
const VALUE: &[u8] = br#"{"id":"rcpt-000000000042","amount":500,"currency":"EUR"}"#;

struct Ctx {
    pool: PgPool,
    idem: Idempotency,
    run: u64,
}

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn one(ctx: &Ctx, phase: Phase, n: u64) -> Result<(), String> {
    let fresh = format!("f{}-{n}", ctx.run);
    let replay = format!("r{}", n % REPLAY_KEYS);
    let e = |e: sqlx::Error| e.to_string();
    match phase {
        Phase::FloorFresh => {
            sqlx::query(
                "INSERT INTO floor_keys (key, value) VALUES ($1, NULL) ON CONFLICT DO NOTHING",
            )
            .bind(&fresh)
            .execute(&ctx.pool)
            .await
            .map_err(e)?;
            sqlx::query("UPDATE floor_keys SET value = $2 WHERE key = $1")
                .bind(&fresh)
                .bind(VALUE)
                .execute(&ctx.pool)
                .await
                .map_err(e)?;
        }
        Phase::IdemFresh => {
            let _: serde_json::Value = ctx
                .idem
                .call("bench", &fresh)
                .run(|| async { Ok::<_, Error>(serde_json::from_slice(VALUE).unwrap()) })
                .await
                .map_err(|e| e.to_string())?;
        }
        Phase::FloorReplay => {
            let _: (Option<Vec<u8>>,) =
                sqlx::query_as("SELECT value FROM floor_keys WHERE key = $1")
                    .bind(&replay)
                    .fetch_one(&ctx.pool)
                    .await
                    .map_err(e)?;
        }
        Phase::IdemReplay => {
            let _: serde_json::Value = ctx
                .idem
                .call("bench", &replay)
                .run(|| async { Err::<serde_json::Value, _>(Error::Codec("not replayed".into())) })
                .await
                .map_err(|e| e.to_string())?;
        }
        Phase::FloorTx => {
            let mut tx = ctx.pool.begin().await.map_err(e)?;
            sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                .bind(&fresh)
                .execute(&mut *tx)
                .await
                .map_err(e)?;
            tx.commit().await.map_err(e)?;
        }
        Phase::IdemTx => {
            let _: u8 = ctx
                .idem
                .call("tx", &fresh)
                .run_in_tx(&ctx.pool, async |tx| {
                    sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                        .bind(&fresh)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| Error::Codec(e.to_string()))?;
                    Ok::<_, Error>(1)
                })
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Runs `phase` with `tasks` tasks for `dur`; returns (calls, seconds).
async fn slice(
    ctx: &Arc<Ctx>,
    phase: Phase,
    tasks: usize,
    dur: Duration,
    seq: &Arc<AtomicU64>,
) -> (u64, f64) {
    let start = Instant::now();
    let end = start + dur;
    let done = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (ctx, seq, done) = (Arc::clone(ctx), Arc::clone(seq), Arc::clone(&done));
            tokio::spawn(async move {
                while Instant::now() < end {
                    let n = seq.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = one(&ctx, phase, n).await {
                        panic!("{phase:?}: {e}");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    (done.load(Ordering::Relaxed), start.elapsed().as_secs_f64())
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn main() {
    let seconds: f64 = arg("--seconds", 6.0);
    let rounds: u32 = arg("--rounds", 12);
    let tasks: usize = arg("--concurrency", 16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let admin = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let db = format!("idem_bench_{}", std::process::id());
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL not reachable at {admin}: {e}"));
        exec_conn(&mut conn, &format!("CREATE DATABASE {db}")).await;
        let url = format!("{}/{db}", &admin[..admin.rfind('/').unwrap()]);
        let pool = PgPoolOptions::new().max_connections(tasks as u32 + 4).connect(&url).await.unwrap();
        let store = PgStore::from_pool(pool.clone());
        store.migrate().await.unwrap();
        exec(&pool, "CREATE TABLE floor_keys (key text COLLATE \"C\" PRIMARY KEY, value bytea)").await;
        exec(&pool, "CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)").await;
        let idem = Idempotency::builder(store).result_ttl(Duration::from_secs(3600)).namespace("b").build();
        let ctx = Arc::new(Ctx { pool: pool.clone(), idem, run: std::process::id() as u64 });
        // Replay keys, completed in both tables.
        for n in 0..REPLAY_KEYS {
            let key = format!("r{n}");
            sqlx::query("INSERT INTO floor_keys VALUES ($1, $2)").bind(&key).bind(VALUE).execute(&pool).await.unwrap();
            let _: serde_json::Value = ctx
                .idem
                .call("bench", &key)
                .run(|| async { Ok::<_, Error>(serde_json::from_slice(VALUE).unwrap()) })
                .await
                .unwrap();
        }
        let seq = Arc::new(AtomicU64::new(1 << 32));
        for p in PHASES {
            slice(&ctx, p, tasks, Duration::from_millis(300), &seq).await; // warm-up
        }
        let per = Duration::from_secs_f64(seconds / rounds as f64);
        let mut totals = [(0u64, 0f64); 6];
        for round in 0..rounds as usize {
            for k in 0..PHASES.len() {
                let k = if round % 2 == 1 { PHASES.len() - 1 - k } else { k };
                let i = (round / 2 + k) % PHASES.len();
                let (n, s) = slice(&ctx, PHASES[i], tasks, per, &seq).await;
                totals[i].0 += n;
                totals[i].1 += s;
            }
        }
        let rate = |p: Phase| {
            let i = PHASES.iter().position(|q| *q == p).unwrap();
            totals[i].0 as f64 / totals[i].1
        };
        println!("\nPostgreSQL {} — {tasks} tasks, {rounds} interleaved rounds, {seconds} s per phase\n", server_version(&pool).await);
        println!("| phase | calls/s | µs/call (latency at {tasks} in flight) |");
        println!("| --- | ---: | ---: |");
        for p in PHASES {
            let r = rate(p);
            println!("| {p:?} | {r:.0} | {:.0} |", tasks as f64 * 1e6 / r);
        }
        println!();
        println!("fresh  idem / floor (INSERT ON CONFLICT + UPDATE): {:.2}", rate(Phase::IdemFresh) / rate(Phase::FloorFresh));
        println!("replay idem / floor (SELECT by primary key):       {:.2}", rate(Phase::IdemReplay) / rate(Phase::FloorReplay));
        println!("run_in_tx / the body's own transaction:            {:.2}", rate(Phase::IdemTx) / rate(Phase::FloorTx));

        // Bytes per row: a completed idem record against a bare row with the same value.
        let (idem_row, floor_row): (f64, f64) = sqlx::query_as(
            "SELECT (SELECT avg(pg_column_size(t.*))::float8 FROM idem_keys t WHERE key LIKE 'b:bench:r%'), \
                    (SELECT avg(pg_column_size(t.*))::float8 FROM floor_keys t WHERE key LIKE 'r%')",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        println!("bytes per row (pg_column_size, {}-byte value): idem {idem_row:.0}, bare (key, value) row {floor_row:.0}", VALUE.len());
        pool.close().await;
        exec_conn(&mut conn, &format!("DROP DATABASE {db} WITH (FORCE)")).await;
    });
}

async fn exec_conn(conn: &mut sqlx::PgConnection, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn server_version(pool: &PgPool) -> String {
    let (v,): (String,) = sqlx::query_as("SHOW server_version")
        .fetch_one(pool)
        .await
        .unwrap();
    v
}
