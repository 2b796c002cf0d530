//! Throughput, latency and memory of idem against the floor: the least a
//! hand-written Redis claim/complete (or GET) could cost on the same
//! connection type (`redis::aio::ConnectionManager`).
//!
//! ```text
//! cargo bench --bench throughput                       # own redis-server, 5 s per phase
//! cargo bench --bench throughput -- --seconds 2 --json # last line: one JSON object
//! cargo bench --bench throughput -- --redis redis://127.0.0.1:6380/
//! cargo bench --bench throughput -- --profile idem_fresh --ops 20000   # one phase, for callgrind
//! ```
//!
//! cargo bench --bench throughput -- --server both    # Redis 7 then Valkey 8.1, each against its own floors
//! ```
//!
//! Options: `--redis URL` (default: start a private redis-server),
//! `--server redis|valkey|both` (`servers.rs`: the Redis phases on a private
//! redis-server, valkey-server, or one after the other, each run a process
//! of its own with its own floors),
//! `--concurrency N` (64), `--seconds S` (5, per phase in total),
//! `--rounds R` (25), `--threads T` (Tokio workers, default 1: on a 2-core
//! machine that leaves Redis a core of its own, as it would have on its own
//! host; 0 = a current-thread runtime),
//! `--replay-keys K` (1000), `--only a,b,..` (`--only durability`: the
//! `Durability` settings against `Async`, `durability.rs`, never run by
//! default), `--json`; PostgreSQL phases
//! first when asked with `--pg` (`postgres.rs`, needs the feature
//! `postgres`, which the crate's tests turn on: `--pg-url URL`,
//! `--pg-concurrency N` (16), `--pg-only` = `--pg` without the Redis phases).
//!
//! All phases run in one process, interleaved: each of R rounds runs a short
//! slice of every phase (rotating which goes first, odd rounds backwards), so
//! that machine drift (frequency, noisy neighbours) hits them alike. Fresh
//! keys go to database 1 of the private server, emptied before every slice,
//! so each slice of a fresh phase starts from the same small key space (a
//! `--redis` server is never flushed: fresh keys then pile up in its
//! database). The ratios are computed from the totals over all rounds; the
//! table and the JSON (`per_round`) also give the lowest, median and highest
//! per-round ratio as a noise gauge. The `client µs` and `redis µs` columns
//! are CPU time per call of this process (`/proc/self/task/*/schedstat`) and
//! of redis-server (`INFO cpu`): what each side spends, whoever is waiting.
//!
//! `--profile PHASE --ops N` runs N calls of one phase and nothing else (no
//! table), for `valgrind --tool=callgrind` on the bench binary, or on a
//! redis-server given with `--redis`: two runs with different N give the
//! instructions per call on either side.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]
// The JSON report is one `json!` object with many fields.
#![recursion_limit = "256"]

mod batch;
mod cpu;
mod durability;
mod keys;
mod memory;
#[cfg(feature = "metrics")]
mod metrics_cost;
mod ops;
mod opts;
mod phases;
#[cfg(feature = "postgres")]
mod postgres;
mod report;
mod servers;
mod wait;

use crate::cpu::{client_cpu, redis_cpu};
use crate::memory::{measure_memory, prefill};
use crate::ops::{Ctx, FLOOR_CLAIM, FLOOR_COMPLETE};
use crate::opts::{Opts, parse_opts, usage};
use crate::phases::{Op, PHASES, Totals, one_call, slice};
use crate::report::report;
use idem::{Idempotency, RedisStore};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn main() {
    let opts = parse_opts();
    if let Some(server) = &opts.server
        && servers::run_each(server)
    {
        return;
    }
    let mut rt = if opts.threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(opts.threads);
        b
    };
    let rt = rt.enable_all().build().expect("tokio runtime");
    #[cfg(feature = "postgres")]
    if opts.pg || opts.pg_only {
        rt.block_on(postgres::run(&opts));
        if opts.pg_only {
            return;
        }
    }
    // Our own server unless told otherwise; dropped (killed) at the end.
    let server = if opts.redis.is_none() {
        Some(idem_testkit::RedisServer::start())
    } else {
        None
    };
    // Fresh keys go to database 1 of our own server, emptied before each
    // slice; a server given with --redis is used as it is, never flushed.
    let (url, fresh_url, flush) = match (&opts.redis, &server) {
        (Some(url), _) => (url.clone(), url.clone(), false),
        (None, Some(s)) => (s.url(), format!("{}1", s.url()), true),
        (None, None) => unreachable!(),
    };
    rt.block_on(run(opts, url, fresh_url, flush));
    drop(server);
}

async fn connect(url: &str) -> ConnectionManager {
    // The configuration RedisStore::connect uses.
    let client = redis::Client::open(url).expect("redis URL");
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(3)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_with_config(client, config)
        .await
        .expect("connect to Redis")
}

async fn run(opts: Opts, url: String, fresh_url: String, flush_fresh: bool) {
    let conn = connect(&url).await;
    let fresh_conn = connect(&fresh_url).await;
    // idem goes through the same connection managers as the floor.
    let store = RedisStore::from_manager(conn.clone());
    let fresh_store = RedisStore::from_manager(fresh_conn.clone());
    let ttl = Duration::from_secs(3600);
    let plain = |store: &RedisStore| Idempotency::builder(store.clone()).result_ttl(ttl).build();
    let lz4 = |store: &RedisStore| {
        Idempotency::builder(store.clone())
            .result_ttl(ttl)
            .compress_above(1024)
            .build()
    };
    let idem = plain(&fresh_store);
    idem.install()
        .expect("install the default for #[idempotent]");
    // From the URL, not the manager: the local cache serves only while
    // the store's feed of forgotten keys is live, and a store made from a
    // manager has no subscriber connection (it would cache nothing).
    let cached_store = RedisStore::connect(&url)
        .await
        .expect("connect the local cache's store to Redis");
    let cached = Idempotency::builder(cached_store)
        .result_ttl(ttl)
        .local_cache(100_000)
        .build();
    let run_id = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u32)
        | 1;
    let ctx = Arc::new(Ctx {
        run: run_id,
        claim: redis::Script::new(FLOOR_CLAIM),
        complete: redis::Script::new(FLOOR_COMPLETE),
        conn,
        fresh_conn,
        flush_fresh,
        idem,
        replayer: plain(&store),
        cached,
        big_plain: plain(&fresh_store),
        big_lz4: lz4(&fresh_store),
        big_plain_r: plain(&store),
        big_lz4_r: lz4(&store),
        replay_keys: opts.replay_keys,
        errors: AtomicU64::new(0),
    });
    // Load the floor's scripts as idem's connect() loads idem's.
    for s in [&ctx.claim, &ctx.complete] {
        let _: String = s
            .load_async(&mut ctx.conn.clone())
            .await
            .expect("SCRIPT LOAD");
    }
    if let Some(name) = &opts.profile {
        let Some(i) = PHASES.iter().position(|p| p.name == *name) else {
            usage()
        };
        let op = PHASES[i].op;
        let small = matches!(op, Op::FloorReplay | Op::IdemReplay | Op::CachedReplay);
        prefill(&ctx, small, matches!(op, Op::BigReplay | Op::BigReplayLz4)).await;
        return profile(&ctx, &opts, i).await;
    }
    prefill(&ctx, true, true).await;
    // The wait phase stands apart: its own stores and keys, not interleaved.
    let waits = opts
        .only
        .as_ref()
        .is_none_or(|o| o.iter().any(|n| n == "wait"));
    if waits {
        wait::print_waits(&wait::measure_waits(&url).await);
    }
    // The batch phase too: `claim_batch`/`finish_batch` against single calls.
    let batches = opts
        .only
        .as_ref()
        .is_none_or(|o| o.iter().any(|n| n == "batch"));
    if batches {
        batch::measure_and_print(&fresh_store, run_id).await;
    }
    // Only when asked: servers of its own (a master and a replica).
    if opts
        .only
        .as_ref()
        .is_some_and(|o| o.iter().any(|n| n == "durability"))
    {
        durability::measure_and_print().await;
        if opts.only.as_ref().is_some_and(|o| o.len() == 1) {
            return;
        }
    }
    // Only when asked: it installs the process's global recorder.
    #[cfg(feature = "metrics")]
    if opts
        .only
        .as_ref()
        .is_some_and(|o| o.iter().any(|n| n == "metrics"))
    {
        metrics_cost::measure(&ctx, opts.concurrency).await;
        return;
    }

    let selected: Vec<usize> = (0..PHASES.len())
        .filter(|&i| {
            opts.only
                .as_ref()
                .is_none_or(|o| o.iter().any(|n| n == PHASES[i].name))
        })
        .collect();
    if selected.is_empty() {
        if waits || batches {
            return;
        }
        usage()
    }
    let tasks_of = |i: usize| PHASES[i].concurrency.unwrap_or(opts.concurrency);

    // Warm-up: every phase once, briefly (connections, caches, allocator,
    // the local cache's first fill), not counted.
    let mut seq = vec![1u64 << 40; PHASES.len()];
    for &i in &selected {
        let (n, _, _) = slice(
            &ctx,
            i,
            tasks_of(i),
            Duration::from_millis(200),
            seq[i],
            false,
        )
        .await;
        seq[i] += n + 1;
    }

    let slice_dur = Duration::from_secs_f64(opts.seconds / opts.rounds as f64);
    let mut totals: Vec<Totals> = (0..PHASES.len()).map(|_| Totals::default()).collect();
    let wall = Instant::now();
    for round in 0..opts.rounds {
        // Rotate the starting phase, and run odd rounds backwards, so that
        // no phase always follows the same one or holds the same position.
        let n = selected.len();
        for k in 0..n {
            let k = if round % 2 == 1 { n - 1 - k } else { k };
            let i = selected[(round / 2 + k) % n];
            let lat = PHASES[i].concurrency == Some(1);
            if ctx.flush_fresh {
                let () = redis::cmd("FLUSHDB")
                    .query_async(&mut ctx.fresh_conn.clone())
                    .await
                    .expect("FLUSHDB of the fresh-key database");
                // Hand the freed pages back now, not during the next slice.
                let _: redis::RedisResult<redis::Value> = redis::cmd("MEMORY")
                    .arg("PURGE")
                    .query_async(&mut ctx.fresh_conn.clone())
                    .await;
            }
            let (cpu0, rcpu0) = (client_cpu(), redis_cpu(&mut ctx.conn.clone()).await);
            let (n, secs, l) = slice(&ctx, i, tasks_of(i), slice_dur, seq[i], lat).await;
            let (cpu1, rcpu1) = (client_cpu(), redis_cpu(&mut ctx.conn.clone()).await);
            seq[i] += n + 1;
            let t = &mut totals[i];
            t.client_cpu += cpu1 - cpu0;
            t.redis_cpu += rcpu1 - rcpu0;
            t.ops += n;
            t.secs += secs;
            t.per_round.push(n as f64 / secs);
            t.latencies_ns.extend(l);
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    let mem = measure_memory(&ctx).await;
    // Which server, and which complete the store chose on it (plain
    // `SET … IFEQ` on Valkey 8.1+ / Redis 8.4+, else the script).
    println!(
        "server: {} (complete: {})",
        fresh_store.server(),
        fresh_store.complete_path()
    );
    report(
        &opts,
        &mut totals,
        &mem,
        wall,
        ctx.errors.load(Ordering::Relaxed),
        &url,
    );
}

/// One phase alone for a fixed number of calls, for callgrind:
/// `valgrind --tool=callgrind target/release/deps/throughput-* --profile idem_fresh --ops 20000`.
async fn profile(ctx: &Arc<Ctx>, opts: &Opts, i: usize) {
    let name = PHASES[i].name;
    let tasks = PHASES[i].concurrency.unwrap_or(opts.concurrency);
    let per_task = opts.ops.div_ceil(tasks as u64);
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let c = Arc::clone(ctx);
            tokio::spawn(async move {
                for n in 0..per_task {
                    one_call(&c, i, t as u16, (1 << 50) + n).await;
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    let n = per_task * tasks as u64;
    println!(
        "{name}: {n} calls in {secs:.3} s = {:.0} calls/s, {} errors",
        n as f64 / secs,
        ctx.errors.load(Ordering::Relaxed)
    );
}
