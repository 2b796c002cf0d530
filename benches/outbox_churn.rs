//! Sustained churn on PostgreSQL: what an hour of `run_in_tx` calls, each
//! publishing one outbox message, does to the tables (dead tuples, size)
//! and to the throughput, with the relay draining the outbox and the reaper
//! deleting expired records, as in production.
//!
//! ```text
//! cargo bench --bench outbox_churn --features postgres -- --minutes 60 --ttl 300
//! ```
//!
//! `--minutes M` (10), `--ttl S` (300: records expire and are reaped),
//! `--tasks N` (16), `--sample S` (60), `--partition S` (0: plain tables;
//! else both partitioned by S-second periods), `--pg-url URL` (default: a private
//! server started for the run with PostgreSQL's default settings, autovacuum
//! on; a database of its own is created and dropped). The relay's sink
//! confirms at once: the broker is not what is measured here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

use async_trait::async_trait;
use idem::outbox::{self, OutboxMessage, Relay, Sink, SinkError};
use idem::postgres::sqlx::{self, Connection, PgConnection};
use idem::postgres::{PgStore, PgStoreConfig, RunInTx};
use idem::{Error, Idempotency};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Confirms at once, counting what it was given.
#[derive(Default)]
struct Confirms(AtomicU64);

#[async_trait]
impl Sink for Confirms {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        self.0.fetch_add(batch.len() as u64, Ordering::Relaxed);
        batch.iter().map(|_| Ok(())).collect()
    }
    fn describe(&self) -> String {
        "confirms at once".into()
    }
}

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn arg_str(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

struct TableStats {
    live: i64,
    dead: i64,
    bytes: i64,
    autovacuums: i64,
    partitions: i64,
}

async fn stats(pool: &sqlx::PgPool, table: &str) -> TableStats {
    // Summed over the partitions of a partitioned table (a plain table is
    // its own one-node tree).
    let (live, dead, bytes, autovacuums, partitions): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT sum(s.n_live_tup)::bigint AS live, sum(s.n_dead_tup)::bigint AS dead, \
                sum(pg_total_relation_size(s.relid))::bigint AS bytes, \
                sum(s.autovacuum_count)::bigint AS autovacuums, count(*) AS partitions \
         FROM pg_stat_user_tables s \
         WHERE s.relid = $1::regclass OR s.relid IN (SELECT relid FROM pg_partition_tree($1::regclass))",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("stats of {table}: {e}"));
    TableStats {
        live,
        dead,
        bytes,
        autovacuums,
        partitions,
    }
}

#[tokio::main]
async fn main() {
    // The relay's and the reaper's warnings, on stderr.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let minutes = arg("--minutes", 10.0);
    let ttl = Duration::from_secs_f64(arg("--ttl", 300.0));
    let tasks = arg("--tasks", 16.0) as usize;
    let sample = Duration::from_secs_f64(arg("--sample", 60.0));
    // A private server by default: its settings are PostgreSQL's defaults
    // (autovacuum on; fsync off, as idem-testkit starts it), not whatever
    // the local one was configured with.
    let private = arg_str("--pg-url")
        .is_none()
        .then(idem_testkit::PgServer::start);
    let admin = arg_str("--pg-url")
        .or_else(|| private.as_ref().map(|s| s.url("postgres")))
        .unwrap_or_default();
    let db = format!("idem_churn_{}", std::process::id());
    let mut conn = PgConnection::connect(&admin)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL not reachable at {admin}: {e}; give --pg-url"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut conn)
        .await
        .expect("create the bench database");
    let base = admin.rfind('/').map_or(admin.as_str(), |i| &admin[..i]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(tasks as u32 + 8)
        .connect(&format!("{base}/{db}"))
        .await
        .expect("connect");
    // `--partition S`: both tables partitioned by S-second periods,
    // retention by dropping partitions (the reaper's tick maintains them).
    let period = arg("--partition", 0.0);
    let config = if period > 0.0 {
        PgStoreConfig::default().partitioned(Duration::from_secs_f64(period))
    } else {
        PgStoreConfig::default()
    };
    let store = PgStore::from_pool_with(pool.clone(), config).expect("--partition");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)")
        .execute(&pool)
        .await
        .expect("orders");
    // Orders are the application's: it deletes old ones itself, here as
    // soon as they are written, so the figures are idem's tables alone.
    let idem = Arc::new(
        Idempotency::builder(store.clone())
            .result_ttl(ttl)
            .namespace("churn")
            .build(),
    );
    let reaper = store.spawn_reaper(Duration::from_secs(10), 2_000);
    let sink = Arc::new(Confirms::default());
    let relay = Relay::new(&store, Arc::clone(&sink)).poll_interval(Duration::from_secs(1));
    let stop = Arc::new(AtomicBool::new(false));
    let relay_task = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            relay
                .run(async move {
                    while !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                })
                .await
        })
    };
    let calls = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..tasks)
        .map(|t| {
            let (idem, pool, stop, calls) = (
                Arc::clone(&idem),
                pool.clone(),
                Arc::clone(&stop),
                Arc::clone(&calls),
            );
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = format!("{t}-{n}");
                    let r: Result<i64, Error> = idem
                        .call("orders.create", &key)
                        .run_in_tx(&pool, async |tx| {
                            let (id,): (i64,) =
                                sqlx::query_as("INSERT INTO orders (req) VALUES ($1) RETURNING id")
                                    .bind(&key)
                                    .fetch_one(&mut *tx)
                                    .await
                                    .map_err(|e| Error::codec(e.to_string()))?;
                            outbox::publish(tx, "orders.created", &key, &id).await?;
                            Ok(id)
                        })
                        .await;
                    if let Err(e) = r {
                        eprintln!("call failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let orders_gc = {
        let (pool, stop) = (pool.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                // In small batches, as an application would: one long
                // DELETE holds back vacuum for every table, the outbox too.
                let _ = sqlx::query(
                    "DELETE FROM orders WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 2000)",
                )
                .execute(&pool)
                .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let (autovacuum,): (String,) = sqlx::query_as("SHOW autovacuum")
        .fetch_one(&pool)
        .await
        .expect("SHOW autovacuum");
    println!(
        "churn: {tasks} tasks of run_in_tx + one outbox message, result TTL {ttl:?}, reaper every 10 s in batches of 2,000, \
         {minutes} min, autovacuum {autovacuum}\n"
    );
    println!(
        "| min | calls/s | relayed/s | idem_keys live | dead | MB | autovacuums | outbox live | dead | MB | autovacuums | backlog | partitions |"
    );
    println!(
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(minutes * 60.0);
    let mut last = (Instant::now(), 0u64, 0u64);
    while Instant::now() < end {
        tokio::time::sleep(sample.min(end.saturating_duration_since(Instant::now()))).await;
        let now = (
            Instant::now(),
            calls.load(Ordering::Relaxed),
            sink.0.load(Ordering::Relaxed),
        );
        let secs = (now.0 - last.0).as_secs_f64();
        let rate = (now.1 - last.1) as f64 / secs;
        let relayed = (now.2 - last.2) as f64 / secs;
        last = now;
        let k = stats(&pool, "idem_keys").await;
        let o = stats(&pool, "idem_keys_outbox").await;
        let backlog = store
            .outbox()
            .backlog()
            .await
            .map(|b| b.pending)
            .unwrap_or(0);
        let mb = |b: i64| b as f64 / 1_048_576.0;
        println!(
            "| {:.0} | {rate:.0} | {relayed:.0} | {} | {} | {:.1} | {} | {} | {} | {:.1} | {} | {backlog} | {} |",
            start.elapsed().as_secs_f64() / 60.0,
            k.live,
            k.dead,
            mb(k.bytes),
            k.autovacuums,
            o.live,
            o.dead,
            mb(o.bytes),
            o.autovacuums,
            k.partitions + o.partitions
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    let _ = orders_gc.await;
    let report = relay_task.await.expect("relay");
    drop(reaper);
    println!(
        "\n{} calls, {} messages relayed",
        calls.load(Ordering::Relaxed),
        report.sent
    );
    pool.close().await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {db} WITH (FORCE)"
    )))
    .execute(&mut conn)
    .await;
}
