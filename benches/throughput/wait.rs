//! The wait phase: `N` callers `.wait()` on one key held by a body of
//! `HOLD`; how many Redis commands the wait costs and how soon after the
//! body returns each waiter has the result (wake-up latency), for 1, 100
//! and 1,000 waiters, polling (a store made with `from_manager`, which has
//! no subscriber) against notification (`RedisStore::connect`), in the
//! same run on the same server.
//!
//! Commands are the server's own count (`INFO commandstats`, every
//! `calls=`), before and after each round, less the `INFO` calls. Latency
//! counts from the moment the body returns, so it includes the holder's
//! `complete` round trip (the same in both modes) and the waiters' last
//! claim.

use idem::{Error, Idempotency, RedisStore};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the holder's body runs: long enough for polling to reach its
/// 250 ms step only once (5, 10, 20, 40, 80 ms … then 160 ms).
const HOLD: Duration = Duration::from_millis(300);
const WAITERS: [usize; 3] = [1, 100, 1000];
const ROUNDS: usize = 3;

pub(crate) struct WaitRow {
    pub(crate) waiters: usize,
    pub(crate) mode: &'static str,
    pub(crate) commands: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
}

async fn total_calls(con: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|l| {
            let calls = l.split("calls=").nth(1)?;
            calls.split(',').next()?.parse::<u64>().ok()
        })
        .sum()
}

/// One round: the holder, then `n` waiters; their wake-up latencies (ms)
/// and the commands Redis served meanwhile.
async fn round(
    idem: &Idempotency,
    key: &str,
    n: usize,
    info: &mut redis::aio::MultiplexedConnection,
) -> (Vec<f64>, u64) {
    let before = total_calls(info).await;
    let done_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let holder = {
        let idem = idem.clone();
        let key = key.to_owned();
        let done_at = Arc::clone(&done_at);
        tokio::spawn(async move {
            idem.call("wait", &key)
                .run(|| async move {
                    let _ = started_tx.send(());
                    tokio::time::sleep(HOLD).await;
                    *done_at.lock().unwrap() = Some(Instant::now());
                    Ok::<_, Error>(1_u32)
                })
                .await
        })
    };
    started_rx.await.expect("the holder started");
    let waiters: Vec<_> = (0..n)
        .map(|_| {
            let idem = idem.clone();
            let key = key.to_owned();
            tokio::spawn(async move {
                let v: Result<u32, Error> = idem
                    .call("wait", &key)
                    .wait(Duration::from_secs(30))
                    .run(|| async { Ok::<_, Error>(2) })
                    .await;
                (v, Instant::now())
            })
        })
        .collect();
    let mut ends = Vec::with_capacity(n);
    for w in waiters {
        let (v, end) = w.await.expect("waiter task");
        assert_eq!(v.expect("waiter"), 1, "a waiter ran the body");
        ends.push(end);
    }
    holder.await.expect("holder task").expect("holder");
    let after = total_calls(info).await;
    let done = done_at.lock().unwrap().expect("the body ran");
    let lat = ends
        .iter()
        .map(|e| e.saturating_duration_since(done).as_secs_f64() * 1e3)
        .collect();
    // The "after" count includes the "before" INFO.
    (lat, after - before - 1)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Every row of the wait table, polling and notified interleaved per round.
pub(crate) async fn measure_waits(url: &str) -> Vec<WaitRow> {
    let client = redis::Client::open(url).expect("redis URL");
    let mut info = client
        .get_multiplexed_async_connection()
        .await
        .expect("INFO connection");
    let manager = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connect to Redis");
    let idem_of = |store: RedisStore| {
        Idempotency::builder(store)
            .namespace("bench-wait")
            .result_ttl(Duration::from_secs(60))
            .build()
    };
    let polling = idem_of(RedisStore::from_manager(manager));
    let notified = idem_of(RedisStore::connect(url).await.expect("RedisStore::connect"));
    let mut rows = Vec::new();
    let run = std::process::id();
    for n in WAITERS {
        let mut lat: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut cmds = [0_u64; 2];
        for r in 0..ROUNDS {
            for (m, idem) in [&polling, &notified].into_iter().enumerate() {
                let key = format!("{run}-{n}-{r}-{m}");
                let (l, c) = round(idem, &key, n, &mut info).await;
                lat[m].extend(l);
                cmds[m] += c;
            }
        }
        for (m, mode) in ["polling", "notified"].into_iter().enumerate() {
            let l = &mut lat[m];
            l.sort_by(f64::total_cmp);
            rows.push(WaitRow {
                waiters: n,
                mode,
                commands: cmds[m] as f64 / ROUNDS as f64,
                p50_ms: percentile(l, 0.5),
                p99_ms: percentile(l, 0.99),
            });
        }
    }
    rows
}

/// The table, in the README's format.
pub(crate) fn print_waits(rows: &[WaitRow]) {
    println!(
        "\nwait: N callers .wait() on one key held {} ms ({ROUNDS} rounds each, same server)",
        HOLD.as_millis()
    );
    println!("| waiters | mode | Redis commands | per waiter | p50 wake-up | p99 wake-up |");
    println!("|---:|---|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.2} ms | {:.2} ms |",
            r.waiters,
            r.mode,
            r.commands,
            r.commands / r.waiters as f64,
            r.p50_ms,
            r.p99_ms
        );
    }
}
