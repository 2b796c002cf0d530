//! PostgreSQL phases (feature `postgres`): idem over `PgStore` against the
//! bare SQL floor (docs/performance.md), measured in the same run, on the same pool,
//! interleaved round by round so that machine drift hits every phase alike.
//!
//! ```text
//! cargo bench --bench throughput --features postgres                  # Redis, then PostgreSQL
//! cargo bench --bench throughput --features postgres -- --pg-only --seconds 12
//! cargo bench --bench throughput --features postgres -- --pg-url postgres://u@host/postgres
//! cargo bench --bench throughput --features postgres -- --pg-only --profile pg_idem_replay --ops 20000
//! ```
//!
//! Floors: a fresh call against one `INSERT … ON CONFLICT DO NOTHING` plus
//! one `UPDATE` by primary key; a replay against one `SELECT` by primary
//! key; `run_in_tx` against the body's own transaction (`BEGIN`, the body's
//! `INSERT`, `COMMIT`); a mixed load (one replay in ten calls) against the
//! same mix of floor statements. The server is `--pg-url` (default `IDEM_PG_URL`,
//! then 127.0.0.1:5432); the bench creates a database of its own there and
//! drops it at the end.

use crate::cpu::{client_cpu, pids_cpu};
use crate::opts::Opts;
use idem::postgres::sqlx::postgres::{PgPool, PgPoolOptions};
use idem::postgres::sqlx::{self, AssertSqlSafe, Connection, PgConnection};
use idem::postgres::{PgStore, RunInTx};
use idem::{Error, Idempotency};
use serde::{Deserialize, Serialize};
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
    FloorMixed,
    IdemMixed,
    FloorTxOutbox,
    IdemTxOutbox,
}

const PHASES: [(Phase, &str); 10] = [
    (Phase::FloorFresh, "pg_floor_fresh"),
    (Phase::IdemFresh, "pg_idem_fresh"),
    (Phase::FloorReplay, "pg_floor_replay"),
    (Phase::IdemReplay, "pg_idem_replay"),
    (Phase::FloorTx, "pg_floor_tx"),
    (Phase::IdemTx, "pg_idem_run_in_tx"),
    (Phase::FloorMixed, "pg_floor_mixed"),
    (Phase::IdemMixed, "pg_idem_mixed"),
    (Phase::FloorTxOutbox, "pg_floor_tx_outbox"),
    (Phase::IdemTxOutbox, "pg_idem_run_in_tx_outbox"),
];

/// In the mixed phases, one call in this many is a replay, the rest fresh:
/// a load where idem's claim forecast (`PgStore`) is wrong one time in ten.
const MIXED_REPLAY_EVERY: u64 = 10;

const REPLAY_KEYS: u64 = 1000;
const VALUE: &[u8] = br#"{"id":"rcpt-000000000042","amount":500,"currency":"EUR"}"#;

struct Ctx {
    pool: PgPool,
    idem: Idempotency,
    run: u64,
}

/// What the bodies return: a typed response, as a handler's would be (its
/// JSON is `VALUE`, the floor's bytes). Built, not parsed, so that the
/// body's own work stays out of the comparison; idem's serialization and
/// replay decoding stay in.
#[derive(Serialize, Deserialize)]
struct Receipt {
    id: String,
    amount: u64,
    currency: String,
}

fn value() -> Receipt {
    Receipt {
        id: "rcpt-000000000042".to_owned(),
        amount: 500,
        currency: "EUR".to_owned(),
    }
}

async fn one(ctx: &Ctx, phase: Phase, n: u64) -> Result<(), String> {
    let phase = match phase {
        Phase::FloorMixed if n.is_multiple_of(MIXED_REPLAY_EVERY) => Phase::FloorReplay,
        Phase::FloorMixed => Phase::FloorFresh,
        Phase::IdemMixed if n.is_multiple_of(MIXED_REPLAY_EVERY) => Phase::IdemReplay,
        Phase::IdemMixed => Phase::IdemFresh,
        other => other,
    };
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
            let _: Receipt = ctx
                .idem
                .call("bench", &fresh)
                .run(|| async { Ok::<_, Error>(value()) })
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
            let _: Receipt = ctx
                .idem
                .call("bench", &replay)
                .run(|| async { Err::<Receipt, _>(Error::codec("not replayed")) })
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
        Phase::FloorTxOutbox => {
            // The body's own transaction plus one bare INSERT into a plain
            // table of the outbox's columns (no unique id, no trigger).
            let mut tx = ctx.pool.begin().await.map_err(e)?;
            sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                .bind(&fresh)
                .execute(&mut *tx)
                .await
                .map_err(e)?;
            sqlx::query(
                "INSERT INTO floor_outbox (id, topic, msg_key, payload) VALUES ($1, $2, $3, $4)",
            )
            .bind(&fresh)
            .bind("orders.created")
            .bind(&fresh)
            .bind(VALUE)
            .execute(&mut *tx)
            .await
            .map_err(e)?;
            tx.commit().await.map_err(e)?;
        }
        Phase::IdemTxOutbox => {
            let _: u8 = ctx
                .idem
                .call("tx", &fresh)
                .run_in_tx(&ctx.pool, async |tx| {
                    sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                        .bind(&fresh)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| Error::codec(e.to_string()))?;
                    idem::outbox::publish(tx, "orders.created", &fresh, &value()).await?;
                    Ok::<_, Error>(1)
                })
                .await
                .map_err(|e| e.to_string())?;
        }
        Phase::FloorMixed | Phase::IdemMixed => unreachable!("resolved above"),
        Phase::IdemTx => {
            let _: u8 = ctx
                .idem
                .call("tx", &fresh)
                .run_in_tx(&ctx.pool, async |tx| {
                    sqlx::query("INSERT INTO orders (req) VALUES ($1)")
                        .bind(&fresh)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| Error::codec(e.to_string()))?;
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
        h.await.expect("bench task panicked");
    }
    (done.load(Ordering::Relaxed), start.elapsed().as_secs_f64())
}

/// The pids of the backends serving this bench's database (the pool's
/// connections), to read their CPU time.
async fn backends(pool: &PgPool) -> Vec<i32> {
    sqlx::query_as::<_, (i32,)>(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()",
    )
    .fetch_all(pool)
    .await
    .map(|rows| rows.into_iter().map(|(p,)| p).collect())
    .unwrap_or_default()
}

async fn exec<'c, E: sqlx::Executor<'c, Database = sqlx::Postgres>>(e: E, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(e)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The PostgreSQL phases and their table.
pub(crate) async fn run(opts: &Opts) {
    let admin = opts.pg_url.clone().unwrap_or_else(|| {
        std::env::var("IDEM_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    });
    let tasks = opts.pg_concurrency;
    let db = format!("idem_bench_{}", std::process::id());
    let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
        panic!(
            "PostgreSQL not reachable at {admin}: {e}; start one, give --pg-url, or build \
             without the postgres feature"
        )
    });
    exec(&mut conn, &format!("CREATE DATABASE {db}")).await;
    let base = admin.rfind('/').map_or(admin.as_str(), |i| &admin[..i]);
    let url = format!("{base}/{db}");
    // sqlx's default pool settings, as an application's pool would have.
    let pool = PgPoolOptions::new()
        .max_connections(tasks as u32 + 4)
        .connect(&url)
        .await
        .expect("connect the bench pool");
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    exec(
        &pool,
        "CREATE TABLE floor_keys (key text COLLATE \"C\" PRIMARY KEY, value bytea)",
    )
    .await;
    exec(
        &pool,
        "CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)",
    )
    .await;
    exec(
        &pool,
        "CREATE TABLE floor_outbox (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         id text NOT NULL, topic text NOT NULL, msg_key text NOT NULL, payload bytea NOT NULL)",
    )
    .await;
    // The outbox phases' messages are drained as in production: a relay
    // runs throughout, its sink confirming at once (the broker is not what
    // is measured). A busy relay turns the inserts' NOTIFY off.
    let relay = idem::outbox::Relay::new(&store, ConfirmsAtOnce);
    let (relay_stop, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(async move {
        relay
            .run(async {
                let _ = relay_stopped.await;
            })
            .await
    });
    let idem = Idempotency::builder(store)
        .result_ttl(Duration::from_secs(3600))
        .namespace("b")
        .build();
    let ctx = Arc::new(Ctx {
        pool: pool.clone(),
        idem,
        run: u64::from(std::process::id()),
    });
    // The floor stores the same bytes idem stores.
    assert_eq!(serde_json::to_vec(&value()).ok().as_deref(), Some(VALUE));
    // Replay keys, completed in both tables.
    for n in 0..REPLAY_KEYS {
        let key = format!("r{n}");
        sqlx::query("INSERT INTO floor_keys VALUES ($1, $2)")
            .bind(&key)
            .bind(VALUE)
            .execute(&pool)
            .await
            .expect("floor replay row");
        let _: Receipt = ctx
            .idem
            .call("bench", &key)
            .run(|| async { Ok::<_, Error>(value()) })
            .await
            .expect("idem replay row");
    }
    let seq = Arc::new(AtomicU64::new(1 << 32));
    if let Some(name) = &opts.profile {
        // One phase alone, one call at a time, for callgrind (`--pg-only
        // --profile pg_idem_replay --ops 20000`).
        let Some((phase, _)) = PHASES.iter().find(|(_, n)| n == name) else {
            panic!("--profile {name}: not a PostgreSQL phase");
        };
        let start = Instant::now();
        for _ in 0..opts.ops {
            let n = seq.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = one(&ctx, *phase, n).await {
                panic!("{name}: {e}");
            }
        }
        println!(
            "{name}: {} calls in {:.3} s",
            opts.ops,
            start.elapsed().as_secs_f64()
        );
        pool.close().await;
        exec(&mut conn, &format!("DROP DATABASE {db} WITH (FORCE)")).await;
        return;
    }
    for (p, _) in PHASES {
        slice(&ctx, p, tasks, Duration::from_millis(300), &seq).await; // warm-up
    }
    let rounds = opts.rounds.max(2);
    let per = Duration::from_secs_f64(opts.seconds / rounds as f64);
    let mut totals = [(0u64, 0f64); PHASES.len()];
    // (client, server) CPU seconds per phase.
    let mut cpu = [(0f64, 0f64); PHASES.len()];
    let mut per_round: Vec<[f64; PHASES.len()]> = Vec::new();
    for round in 0..rounds {
        let mut rates = [0f64; PHASES.len()];
        for k in 0..PHASES.len() {
            let k = if round % 2 == 1 {
                PHASES.len() - 1 - k
            } else {
                k
            };
            let i = (round / 2 + k) % PHASES.len();
            let before = (client_cpu(), pids_cpu(&backends(&pool).await));
            let (n, s) = slice(&ctx, PHASES[i].0, tasks, per, &seq).await;
            let pids = backends(&pool).await;
            cpu[i].0 += client_cpu() - before.0;
            // Backends opened during the slice started at 0; closed ones
            // are lost (the pool keeps its connections, so rarely).
            cpu[i].1 += pids_cpu(&pids) - before.1;
            totals[i].0 += n;
            totals[i].1 += s;
            rates[i] = n as f64 / s;
        }
        per_round.push(rates);
    }
    let idx = |p: Phase| PHASES.iter().position(|q| q.0 == p).expect("a phase");
    let rate = |p: Phase| totals[idx(p)].0 as f64 / totals[idx(p)].1;
    let spread = |a: Phase, b: Phase| {
        let mut r: Vec<f64> = per_round.iter().map(|x| x[idx(a)] / x[idx(b)]).collect();
        r.sort_by(f64::total_cmp);
        (r[0], r[r.len() / 2], r[r.len() - 1])
    };

    let (version,): (String,) = sqlx::query_as("SHOW server_version")
        .fetch_one(&pool)
        .await
        .expect("server_version");
    println!(
        "\nPostgreSQL {version}: {tasks} tasks, one pool of {} connections, {rounds} interleaved rounds, {} s per phase\n",
        tasks + 4,
        opts.seconds
    );
    println!(
        "| phase | calls/s | µs/call at {tasks} in flight | client CPU µs/call | server CPU µs/call |"
    );
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (p, name) in PHASES {
        let r = rate(p);
        let calls = totals[idx(p)].0.max(1) as f64;
        let (client, server) = cpu[idx(p)];
        println!(
            "| {name} | {r:.0} | {:.0} | {:.1} | {:.1} |",
            tasks as f64 * 1e6 / r,
            client * 1e6 / calls,
            server * 1e6 / calls
        );
    }
    println!();
    for (what, a, b) in [
        (
            "fresh     idem / floor (INSERT ON CONFLICT + UPDATE)",
            Phase::IdemFresh,
            Phase::FloorFresh,
        ),
        (
            "replay    idem / floor (SELECT by primary key)      ",
            Phase::IdemReplay,
            Phase::FloorReplay,
        ),
        (
            "mixed     idem / floor (1 replay in 10 calls)        ",
            Phase::IdemMixed,
            Phase::FloorMixed,
        ),
        (
            "run_in_tx idem / the body's own transaction         ",
            Phase::IdemTx,
            Phase::FloorTx,
        ),
        (
            "outbox    idem / the body's tx + one bare INSERT    ",
            Phase::IdemTxOutbox,
            Phase::FloorTxOutbox,
        ),
    ] {
        let (lo, mid, hi) = spread(a, b);
        println!(
            "{what}: {:.2}  (per round: min {lo:.2}, median {mid:.2}, max {hi:.2})",
            rate(a) / rate(b)
        );
    }
    let extra_us =
        tasks as f64 * 1e6 / rate(Phase::IdemTx) - tasks as f64 * 1e6 / rate(Phase::FloorTx);
    println!(
        "run_in_tx adds {:.0} µs per call at {tasks} in flight",
        extra_us
    );
    // What one published message adds: to idem's run_in_tx, against what
    // one bare INSERT adds to the body's own transaction.
    let us = |p: Phase| tasks as f64 * 1e6 / rate(p);
    println!(
        "outbox::publish adds {:.0} µs per call to run_in_tx; one bare INSERT adds {:.0} µs to the body's transaction",
        us(Phase::IdemTxOutbox) - us(Phase::IdemTx),
        us(Phase::FloorTxOutbox) - us(Phase::FloorTx)
    );

    // Bytes per row: a completed idem record against a bare row with the same value.
    let (idem_row, floor_row): (f64, f64) = sqlx::query_as(
        "SELECT (SELECT avg(pg_column_size(t.*))::float8 FROM idem_keys t WHERE key LIKE 'b:bench:r%'), \
                (SELECT avg(pg_column_size(t.*))::float8 FROM floor_keys t WHERE key LIKE 'r%')",
    )
    .fetch_one(&pool)
    .await
    .expect("row sizes");
    println!(
        "bytes per row (pg_column_size, {}-byte value): idem {idem_row:.0}, bare (key, value) row {floor_row:.0}\n",
        VALUE.len()
    );
    let _ = relay_stop.send(());
    let relayed = relay.await.map(|r| r.sent).unwrap_or(0);
    println!("the relay published {relayed} outbox messages meanwhile\n");
    pool.close().await;
    exec(&mut conn, &format!("DROP DATABASE {db} WITH (FORCE)")).await;
}

/// The relay's sink in the bench: confirms every message at once.
struct ConfirmsAtOnce;

#[async_trait::async_trait]
impl idem::outbox::Sink for ConfirmsAtOnce {
    async fn send(
        &self,
        batch: &[idem::outbox::OutboxMessage],
    ) -> Vec<Result<(), idem::outbox::SinkError>> {
        batch.iter().map(|_| Ok(())).collect()
    }
    fn describe(&self) -> String {
        "confirms at once".into()
    }
}
