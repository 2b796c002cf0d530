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
//! Options: `--redis URL` (default: start a private redis-server),
//! `--concurrency N` (64), `--seconds S` (5, per phase in total),
//! `--rounds R` (25), `--threads T` (Tokio workers, default 1: on a 2-core
//! machine that leaves Redis a core of its own, as it would have on its own
//! host; 0 = a current-thread runtime),
//! `--replay-keys K` (1000), `--only a,b,..`, `--json`.
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

use idem::{Idempotency, RedisStore, idempotent};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- options

struct Opts {
    redis: Option<String>,
    concurrency: usize,
    seconds: f64,
    rounds: usize,
    threads: usize,
    replay_keys: u64,
    only: Option<Vec<String>>,
    json: bool,
    profile: Option<String>,
    ops: u64,
}

fn usage() -> ! {
    eprintln!(
        "usage: cargo bench --bench throughput -- [--redis URL] [--concurrency N] [--seconds S] \
         [--rounds R] [--threads T] [--replay-keys K] [--only PHASE,..] [--json] \
         [--profile PHASE --ops N]\nphases: {}",
        PHASES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
    );
    std::process::exit(2)
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        redis: None,
        concurrency: 64,
        seconds: 5.0,
        rounds: 25,
        threads: 1,
        replay_keys: 1000,
        only: None,
        json: false,
        profile: None,
        ops: 20_000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                usage()
            })
        };
        fn num<T: std::str::FromStr>(name: &str, v: String) -> T {
            v.parse().unwrap_or_else(|_| {
                eprintln!("{name}: not a number: {v}");
                usage()
            })
        }
        match a.as_str() {
            "--redis" => o.redis = Some(value("--redis")),
            "--concurrency" | "-c" => o.concurrency = num("--concurrency", value("--concurrency")),
            "--seconds" | "-s" => o.seconds = num("--seconds", value("--seconds")),
            "--rounds" => o.rounds = num("--rounds", value("--rounds")),
            "--threads" => o.threads = num("--threads", value("--threads")),
            "--replay-keys" => o.replay_keys = num("--replay-keys", value("--replay-keys")),
            "--only" => {
                o.only = Some(value("--only").split(',').map(str::to_owned).collect());
            }
            "--profile" => o.profile = Some(value("--profile")),
            "--ops" => o.ops = num("--ops", value("--ops")),
            "--json" => o.json = true,
            // What `cargo bench` passes to a harness = false target.
            "--bench" => {}
            "-h" | "--help" => usage(),
            other if other.starts_with('-') => {
                eprintln!("unknown option {other}");
                usage()
            }
            _ => {} // a cargo bench name filter: this bench has one target
        }
    }
    // Fresh keys hold the task number in 4 digits.
    if !(1..=9999).contains(&o.concurrency)
        || o.rounds == 0
        || o.seconds <= 0.0
        || o.replay_keys == 0
    {
        usage()
    }
    o
}

// ---------------------------------------------------------------- keys and values

/// The namespace and scope of every idem record here: stored keys are
/// `idem:bench:<36-byte key>` (47 bytes). The floor's keys have the same
/// length: `flor:bench:<36-byte key>`.
const SCOPE: &str = "bench";
const FLOOR_PREFIX: &str = "flor:bench:";
const PLAIN_PREFIX: &str = "plan:bench:";

/// The value every small body returns: 62 characters, so its JSON (what idem
/// stores, and what the floor stores) is 64 bytes.
const VALUE: &str = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
static VALUE_JSON: OnceLock<Vec<u8>> = OnceLock::new();

fn value_json() -> &'static [u8] {
    VALUE_JSON.get_or_init(|| serde_json::to_vec(VALUE).unwrap())
}

/// A 36-byte user key, unique per (run, phase, task, sequence number), written
/// straight into whatever buffer builds the stored key (no temporary String).
#[derive(Clone, Copy)]
struct FreshKey {
    run: u32,
    phase: u8,
    task: u16,
    seq: u64,
}

impl fmt::Display for FreshKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 8 hex + '-' + 2 hex + 4 digits + '-' + 20 digits = 36 bytes, by
        // hand: `{:020}` padding would cost more than some of what we measure.
        let mut b = [b'0'; 36];
        hex(&mut b[0..8], u64::from(self.run));
        b[8] = b'-';
        hex(&mut b[9..11], u64::from(self.phase));
        dec(&mut b[11..15], u64::from(self.task));
        b[15] = b'-';
        dec(&mut b[16..36], self.seq);
        f.write_str(std::str::from_utf8(&b).unwrap())
    }
}

fn hex(out: &mut [u8], mut v: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b"0123456789abcdef"[(v & 0xf) as usize];
        v >>= 4;
    }
}

fn dec(out: &mut [u8], mut v: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (v % 10) as u8;
        v /= 10;
    }
}

/// One of the pre-filled replay keys, also 36 bytes.
#[derive(Clone, Copy)]
struct ReplayKey {
    run: u32,
    set: u8,
    idx: u64,
}

impl fmt::Display for ReplayKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 8 hex + "-r" + 1 hex + '-' + 24 digits = 36 bytes.
        let mut b = [b'0'; 36];
        hex(&mut b[0..8], u64::from(self.run));
        b[8] = b'-';
        b[9] = b'r';
        hex(&mut b[10..11], u64::from(self.set));
        b[11] = b'-';
        dec(&mut b[12..36], self.idx);
        f.write_str(std::str::from_utf8(&b).unwrap())
    }
}

/// A large, repetitive JSON value for the compression phases: 170 rows of
/// about 97 bytes (16.4 KB of JSON). Rows are `Copy`, so a body returning a
/// clone pays one memcpy, not 170 allocations.
#[derive(Clone, Copy, Serialize, Deserialize)]
struct Row {
    id: u64,
    price_cents: u64,
    quantity: u32,
    status: Status,
    flags: [bool; 4],
}

#[derive(Clone, Copy, Serialize, Deserialize)]
enum Status {
    Active,
    Backordered,
}

static BIG: OnceLock<Vec<Row>> = OnceLock::new();

fn big_value() -> &'static Vec<Row> {
    BIG.get_or_init(|| {
        (0..170u64)
            .map(|i| Row {
                id: 100_000 + i,
                price_cents: 1999 + (i % 7) * 100,
                quantity: (i % 5) as u32 + 1,
                status: if i % 11 == 0 {
                    Status::Backordered
                } else {
                    Status::Active
                },
                flags: [i % 2 == 0, false, true, i % 3 == 0],
            })
            .collect()
    })
}

// ---------------------------------------------------------------- the operations

/// The floor's claim: take a fresh key, nothing else.
const FLOOR_CLAIM: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])";
/// The floor's complete: store the value over it.
const FLOOR_COMPLETE: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])";
const TTL_MS: u64 = 3_600_000;
/// The floor's stand-in for an owner token (same size as idem's).
const FLOOR_TOKEN: &[u8; 32] = b"0123456789abcdef0123456789abcdef";

struct Ctx {
    run: u32,
    /// Database 0: the replay keys (kept for the whole run).
    conn: ConnectionManager,
    /// Database 1 of our own server (emptied before each slice, so every
    /// slice of a fresh phase starts from the same small key space), or the
    /// `--redis` URL's database.
    fresh_conn: ConnectionManager,
    flush_fresh: bool,
    claim: redis::Script,
    complete: redis::Script,
    /// No cache, no compression: what `#[idempotent]` (installed globally)
    /// and the hand-written calls use.
    idem: Idempotency,
    /// Over database 0, no cache.
    replayer: Idempotency,
    /// Over database 0, `local_cache(100_000)`.
    cached: Idempotency,
    /// Over the fresh database, without and with compression.
    big_plain: Idempotency,
    big_lz4: Idempotency,
    /// The same two over database 0, for the big replays.
    big_plain_r: Idempotency,
    big_lz4_r: Idempotency,
    replay_keys: u64,
    errors: AtomicU64,
}

/// The `#[idempotent]` form of the no-op body (uses the installed default).
#[idempotent(key = key, scope = "bench", ttl = "1h")]
async fn noop(key: FreshKey) -> Result<String, idem::Error> {
    Ok(VALUE.to_owned())
}

/// The same call written by hand.
async fn noop_by_hand(idem: &Idempotency, key: FreshKey) -> Result<String, idem::Error> {
    idem.call(SCOPE, key)
        .ttl(Duration::from_secs(3600))
        .run(|| async { Ok(VALUE.to_owned()) })
        .await
}

impl Ctx {
    fn error(&self, what: &str, e: &dyn fmt::Display) {
        if self.errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("error in {what}: {e}");
        }
    }

    async fn floor_fresh(&self, key: FreshKey) {
        let mut conn = self.fresh_conn.clone();
        let full = format!("{FLOOR_PREFIX}{key}");
        let claimed: redis::RedisResult<redis::Value> = self
            .claim
            .key(&full)
            .arg(&FLOOR_TOKEN[..])
            .arg(TTL_MS)
            .invoke_async(&mut conn)
            .await;
        match claimed {
            Ok(redis::Value::Okay) => {}
            Ok(other) => return self.error("floor claim", &format!("{other:?}")),
            Err(e) => return self.error("floor claim", &e),
        }
        let done: redis::RedisResult<redis::Value> = self
            .complete
            .key(&full)
            .arg(value_json())
            .arg(TTL_MS)
            .invoke_async(&mut conn)
            .await;
        if let Err(e) = done {
            self.error("floor complete", &e);
        }
    }

    async fn idem_fresh(&self, key: FreshKey) {
        if let Err(e) = noop(key).await {
            self.error("idem fresh (macro)", &e);
        }
    }

    async fn hand_fresh(&self, key: FreshKey) {
        if let Err(e) = noop_by_hand(&self.idem, key).await {
            self.error("idem fresh (by hand)", &e);
        }
    }

    /// The big records are fewer: each is 16 KiB.
    fn big_keys(&self) -> u64 {
        self.replay_keys.min(100)
    }

    fn replay_key(&self, set: u8, task: u16, seq: u64) -> ReplayKey {
        ReplayKey {
            run: self.run,
            set,
            idx: (u64::from(task) * 7919 + seq)
                % if set == 0 {
                    self.replay_keys
                } else {
                    self.big_keys()
                },
        }
    }

    async fn floor_replay(&self, key: ReplayKey) {
        let mut conn = self.conn.clone();
        let got: redis::RedisResult<Vec<u8>> = redis::cmd("GET")
            .arg(format!("{FLOOR_PREFIX}{key}"))
            .query_async(&mut conn)
            .await;
        match got {
            Ok(v) if v.len() == 64 => {}
            Ok(v) => self.error("floor replay", &format!("{} bytes", v.len())),
            Err(e) => self.error("floor replay", &e),
        }
    }

    async fn idem_replay(&self, idem: &Idempotency, key: ReplayKey, what: &str) {
        let r: Result<(String, idem::Outcome), idem::Error> = idem
            .call(SCOPE, key)
            .ttl(Duration::from_secs(3600))
            .run_outcome(|| async { Ok(String::new()) })
            .await;
        match r {
            Ok((_, idem::Outcome::Replayed)) => {}
            Ok((_, o)) => self.error(what, &format!("outcome {o}, expected replayed")),
            Err(e) => self.error(what, &e),
        }
    }

    async fn big_fresh(&self, idem: &Idempotency, key: FreshKey) {
        let r: Result<Vec<Row>, idem::Error> = idem
            .call("big", key)
            .ttl(Duration::from_secs(3600))
            .run(|| async { Ok(big_value().clone()) })
            .await;
        if let Err(e) = r {
            self.error("big fresh", &e);
        }
    }

    async fn big_replay(&self, idem: &Idempotency, key: ReplayKey) {
        let r: Result<(Vec<Row>, idem::Outcome), idem::Error> = idem
            .call("big", key)
            .ttl(Duration::from_secs(3600))
            .run_outcome(|| async { Ok(Vec::new()) })
            .await;
        match r {
            Ok((v, idem::Outcome::Replayed)) if v.len() == 170 => {}
            Ok((_, o)) => self.error("big replay", &format!("outcome {o}")),
            Err(e) => self.error("big replay", &e),
        }
    }
}

// ---------------------------------------------------------------- phases

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    FloorFresh,
    IdemFresh,
    HandFresh,
    FloorReplay,
    IdemReplay,
    CachedReplay,
    BigFresh,
    BigFreshLz4,
    BigReplay,
    BigReplayLz4,
}

struct PhaseDef {
    name: &'static str,
    op: Op,
    /// `None`: the `--concurrency` option; `Some(1)`: one call at a time,
    /// latencies recorded.
    concurrency: Option<usize>,
    what: &'static str,
}

const PHASES: &[PhaseDef] = &[
    PhaseDef {
        name: "floor_fresh",
        op: Op::FloorFresh,
        concurrency: None,
        what: "minimal Lua claim + complete, fresh key",
    },
    PhaseDef {
        name: "idem_fresh",
        op: Op::IdemFresh,
        concurrency: None,
        what: "#[idempotent] no-op body, fresh key",
    },
    PhaseDef {
        name: "hand_fresh",
        op: Op::HandFresh,
        concurrency: None,
        what: "idem.call(..).run(..) no-op body, fresh key",
    },
    PhaseDef {
        name: "floor_replay",
        op: Op::FloorReplay,
        concurrency: None,
        what: "one GET of an existing key",
    },
    PhaseDef {
        name: "idem_replay",
        op: Op::IdemReplay,
        concurrency: None,
        what: "call on a completed key",
    },
    PhaseDef {
        name: "cached_replay",
        op: Op::CachedReplay,
        concurrency: None,
        what: "call on a completed key, local_cache(100_000)",
    },
    PhaseDef {
        name: "floor_fresh_c1",
        op: Op::FloorFresh,
        concurrency: Some(1),
        what: "floor_fresh, one at a time",
    },
    PhaseDef {
        name: "idem_fresh_c1",
        op: Op::IdemFresh,
        concurrency: Some(1),
        what: "idem_fresh, one at a time",
    },
    PhaseDef {
        name: "big_fresh",
        op: Op::BigFresh,
        concurrency: Some(1),
        what: "16 KiB JSON result, fresh key, uncompressed",
    },
    PhaseDef {
        name: "big_fresh_lz4",
        op: Op::BigFreshLz4,
        concurrency: Some(1),
        what: "16 KiB JSON result, fresh key, compress_above(1024)",
    },
    PhaseDef {
        name: "big_replay",
        op: Op::BigReplay,
        concurrency: Some(1),
        what: "16 KiB JSON replay, uncompressed",
    },
    PhaseDef {
        name: "big_replay_lz4",
        op: Op::BigReplayLz4,
        concurrency: Some(1),
        what: "16 KiB JSON replay, compressed",
    },
];

#[derive(Default)]
struct Totals {
    ops: u64,
    secs: f64,
    /// ops/s of each round, for the spread of the ratios.
    per_round: Vec<f64>,
    latencies_ns: Vec<u64>,
    /// CPU seconds this process and redis-server spent in the phase.
    client_cpu: f64,
    redis_cpu: f64,
}

impl Totals {
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    fn client_us_per_call(&self) -> f64 {
        self.client_cpu * 1e6 / self.ops as f64
    }

    fn redis_us_per_call(&self) -> f64 {
        self.redis_cpu * 1e6 / self.ops as f64
    }

    fn percentile_us(&mut self, p: f64) -> Option<f64> {
        if self.latencies_ns.is_empty() {
            return None;
        }
        self.latencies_ns.sort_unstable();
        let idx = ((self.latencies_ns.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(self.latencies_ns.len() - 1);
        Some(self.latencies_ns[idx] as f64 / 1000.0)
    }
}

/// One call of a phase's operation. `seq` numbers the task's calls; fresh
/// keys are unique per (phase, task, seq).
async fn one_call(c: &Ctx, phase: usize, task: u16, seq: u64) {
    let fresh = FreshKey {
        run: c.run,
        phase: phase as u8,
        task,
        seq,
    };
    match PHASES[phase].op {
        Op::FloorFresh => c.floor_fresh(fresh).await,
        Op::IdemFresh => c.idem_fresh(fresh).await,
        Op::HandFresh => c.hand_fresh(fresh).await,
        Op::FloorReplay => c.floor_replay(c.replay_key(0, task, seq)).await,
        Op::IdemReplay => {
            c.idem_replay(&c.replayer, c.replay_key(0, task, seq), "idem replay")
                .await
        }
        Op::CachedReplay => {
            c.idem_replay(&c.cached, c.replay_key(0, task, seq), "cached replay")
                .await
        }
        Op::BigFresh => c.big_fresh(&c.big_plain, fresh).await,
        Op::BigFreshLz4 => c.big_fresh(&c.big_lz4, fresh).await,
        Op::BigReplay => {
            c.big_replay(&c.big_plain_r, c.replay_key(1, task, seq))
                .await
        }
        Op::BigReplayLz4 => c.big_replay(&c.big_lz4_r, c.replay_key(2, task, seq)).await,
    }
}

/// Runs one slice of a phase: `tasks` tasks calling until `dur` is over.
/// Returns the calls made, the time until the last one finished and, when
/// asked, each call's latency. `seq0` keeps fresh keys unique across slices.
async fn slice(
    ctx: &Arc<Ctx>,
    phase: usize,
    tasks: usize,
    dur: Duration,
    seq0: u64,
    latencies: bool,
) -> (u64, f64, Vec<u64>) {
    let start = Instant::now();
    let deadline = start + dur;
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let c = Arc::clone(ctx);
            tokio::spawn(async move {
                let task = t as u16;
                let mut n = 0u64;
                let mut lat = Vec::new();
                // The deadline is checked per call, not by a timer task: a
                // cached replay never yields, so a timer could starve.
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        break;
                    }
                    one_call(&c, phase, task, seq0 + n).await;
                    if latencies {
                        lat.push(t0.elapsed().as_nanos() as u64);
                    }
                    n += 1;
                }
                (n, lat)
            })
        })
        .collect();
    let mut ops = 0;
    let mut all = Vec::new();
    for h in handles {
        let (n, lat) = h.await.expect("bench task panicked");
        ops += n;
        all.extend(lat);
    }
    (ops, start.elapsed().as_secs_f64(), all)
}

// ---------------------------------------------------------------- CPU accounting

/// CPU time of every thread of this process, in seconds (Linux:
/// `/proc/self/task/*/schedstat`, nanosecond resolution); 0 elsewhere.
fn client_cpu() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut ns = 0u64;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
        }
    }
    ns as f64 / 1e9
}

/// CPU time of the Redis server so far (`INFO cpu`), in seconds.
async fn redis_cpu(conn: &mut ConnectionManager) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| *k == "used_cpu_sys" || *k == "used_cpu_user")
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

// ---------------------------------------------------------------- setup and memory

async fn memory_usage(conn: &mut ConnectionManager, key: &str) -> i64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .query_async(conn)
        .await
        .expect("MEMORY USAGE")
}

async fn strlen(conn: &mut ConnectionManager, key: &str) -> i64 {
    redis::cmd("STRLEN")
        .arg(key)
        .query_async(conn)
        .await
        .expect("STRLEN")
}

/// Fills the replay key sets: the floor's plain strings and idem's records
/// of the 64-byte value (`small`), the 16 KiB records with and without
/// compression (`big`).
async fn prefill(ctx: &Ctx, small: bool, big: bool) {
    if small {
        prefill_small(ctx).await;
    }
    if big {
        prefill_big(ctx).await;
    }
}

async fn prefill_small(ctx: &Ctx) {
    let mut conn = ctx.conn.clone();
    let mut pipe = redis::pipe();
    for idx in 0..ctx.replay_keys {
        let key = ReplayKey {
            run: ctx.run,
            set: 0,
            idx,
        };
        pipe.cmd("SET")
            .arg(format!("{FLOOR_PREFIX}{key}"))
            .arg(value_json())
            .arg("PX")
            .arg(TTL_MS)
            .ignore();
    }
    let () = pipe
        .query_async(&mut conn)
        .await
        .expect("prefill floor keys");
    for idx in 0..ctx.replay_keys {
        let _: String = ctx
            .replayer
            .call(
                SCOPE,
                ReplayKey {
                    run: ctx.run,
                    set: 0,
                    idx,
                },
            )
            .ttl(Duration::from_secs(3600))
            .run(|| async { Ok::<_, idem::Error>(VALUE.to_owned()) })
            .await
            .expect("prefill idem keys");
    }
}

async fn prefill_big(ctx: &Ctx) {
    // Fewer big records: each is 16 KiB.
    for idx in 0..ctx.big_keys() {
        for (set, idem) in [(1, &ctx.big_plain_r), (2, &ctx.big_lz4_r)] {
            let _: Vec<Row> = idem
                .call(
                    "big",
                    ReplayKey {
                        run: ctx.run,
                        set,
                        idx,
                    },
                )
                .ttl(Duration::from_secs(3600))
                .run(|| async { Ok::<_, idem::Error>(big_value().clone()) })
                .await
                .expect("prefill big keys");
        }
    }
}

struct Memory {
    idem_bytes: i64,
    idem_fp_bytes: i64,
    plain_bytes: i64,
    plain_px_bytes: i64,
    idem_strlen: i64,
    plain_strlen: i64,
    key_len: usize,
    big_plain_bytes: i64,
    big_lz4_bytes: i64,
    big_plain_strlen: i64,
    big_lz4_strlen: i64,
    big_json_len: usize,
}

async fn measure_memory(ctx: &Ctx) -> Memory {
    let mut conn = ctx.fresh_conn.clone();
    let mut conn0 = ctx.conn.clone();
    let key = FreshKey {
        run: ctx.run,
        phase: 0xff,
        task: 0,
        seq: 0,
    };
    assert_eq!(key.to_string().len(), 36);
    let _: String = noop_by_hand(&ctx.idem, key).await.expect("memory record");
    let fp_key = FreshKey { seq: 1, ..key };
    let _: String = ctx
        .idem
        .call(SCOPE, fp_key)
        .ttl(Duration::from_secs(3600))
        .fingerprint(&("charge", 500, "EUR"))
        .run(|| async { Ok::<_, idem::Error>(VALUE.to_owned()) })
        .await
        .expect("memory record with a fingerprint");
    let idem_key = format!("idem:{SCOPE}:{key}");
    let plain_key = format!("{PLAIN_PREFIX}{key}");
    let plain_px_key = format!("plpx:bench:{key}");
    assert_eq!(idem_key.len(), plain_key.len());
    assert_eq!(idem_key.len(), plain_px_key.len());
    let () = redis::cmd("SET")
        .arg(&plain_key)
        .arg(value_json())
        .query_async(&mut conn)
        .await
        .unwrap();
    let () = redis::cmd("SET")
        .arg(&plain_px_key)
        .arg(value_json())
        .arg("PX")
        .arg(TTL_MS)
        .query_async(&mut conn)
        .await
        .unwrap();
    let big_json_len = serde_json::to_vec(big_value()).unwrap().len();
    let big = |set| {
        format!(
            "idem:big:{}",
            ReplayKey {
                run: ctx.run,
                set,
                idx: 0
            }
        )
    };
    Memory {
        idem_bytes: memory_usage(&mut conn, &idem_key).await,
        idem_fp_bytes: memory_usage(&mut conn, &format!("idem:{SCOPE}:{fp_key}")).await,
        plain_bytes: memory_usage(&mut conn, &plain_key).await,
        plain_px_bytes: memory_usage(&mut conn, &plain_px_key).await,
        idem_strlen: strlen(&mut conn, &idem_key).await,
        plain_strlen: strlen(&mut conn, &plain_key).await,
        key_len: idem_key.len(),
        big_plain_bytes: memory_usage(&mut conn0, &big(1)).await,
        big_lz4_bytes: memory_usage(&mut conn0, &big(2)).await,
        big_plain_strlen: strlen(&mut conn0, &big(1)).await,
        big_lz4_strlen: strlen(&mut conn0, &big(2)).await,
        big_json_len,
    }
}

// ---------------------------------------------------------------- main

fn main() {
    let opts = parse_opts();
    let mut rt = if opts.threads == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(opts.threads);
        b
    };
    let rt = rt.enable_all().build().expect("tokio runtime");
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
    let cached = Idempotency::builder(store.clone())
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

    let selected: Vec<usize> = (0..PHASES.len())
        .filter(|&i| {
            opts.only
                .as_ref()
                .is_none_or(|o| o.iter().any(|n| n == PHASES[i].name))
        })
        .collect();
    if selected.is_empty() {
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

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// Lowest, median and highest per-round ratio of two phases.
fn spread(a: &Totals, b: &Totals) -> Option<(f64, f64, f64)> {
    let mut r: Vec<f64> = a
        .per_round
        .iter()
        .zip(&b.per_round)
        .map(|(x, y)| x / y)
        .collect();
    if r.is_empty() {
        return None;
    }
    r.sort_by(f64::total_cmp);
    let mid = if r.len() % 2 == 1 {
        r[r.len() / 2]
    } else {
        (r[r.len() / 2 - 1] + r[r.len() / 2]) / 2.0
    };
    Some((r[0], mid, r[r.len() - 1]))
}

/// `[min, median, max]` of the per-round ratios, or null.
fn spread_json(a: &Totals, b: &Totals) -> serde_json::Value {
    spread(a, b).map_or(serde_json::Value::Null, |(lo, mid, hi)| {
        json!([round3(lo), round3(mid), round3(hi)])
    })
}

fn round3(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        serde_json::Value::Null
    }
}

fn round1(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!((x * 10.0).round() / 10.0)
    } else {
        serde_json::Value::Null
    }
}

fn report(opts: &Opts, totals: &mut [Totals], mem: &Memory, wall: f64, errors: u64, url: &str) {
    let idx = |name: &str| PHASES.iter().position(|p| p.name == name).unwrap();
    let rate = |t: &[Totals], name: &str| t[idx(name)].rate();
    let mut pct = |name: &str, p: f64| totals[idx(name)].percentile_us(p);
    let lat: Vec<(usize, Option<f64>, Option<f64>)> = (0..PHASES.len())
        .map(|i| (i, pct(PHASES[i].name, 0.50), pct(PHASES[i].name, 0.99)))
        .collect();
    let p = |name: &str, which: usize| -> f64 {
        let l = &lat[idx(name)];
        (if which == 50 { l.1 } else { l.2 }).unwrap_or(f64::NAN)
    };

    let shown = if opts.redis.is_some() {
        url
    } else {
        "private redis-server"
    };
    let threads = if opts.threads == 0 {
        "current-thread".to_owned()
    } else {
        format!("{} worker(s)", opts.threads)
    };
    println!(
        "\nidem throughput: {} per phase in {} rounds, concurrency {}, Tokio {threads}, {shown}; {:.1} s in all",
        format_secs(opts.seconds),
        opts.rounds,
        opts.concurrency,
        wall
    );
    println!(
        "{:<16} {:>4} {:>10} {:>12} {:>9} {:>9} {:>11} {:>11}  what",
        "phase", "c", "calls", "calls/s", "p50 µs", "p99 µs", "client µs", "redis µs"
    );
    for (i, def) in PHASES.iter().enumerate() {
        let t = &totals[i];
        if t.ops == 0 && t.secs == 0.0 {
            continue;
        }
        let fmt_us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "{:<16} {:>4} {:>10} {:>12.0} {:>9} {:>9} {:>11.2} {:>11.2}  {}",
            def.name,
            def.concurrency.unwrap_or(opts.concurrency),
            t.ops,
            t.rate(),
            fmt_us(lat[i].1),
            fmt_us(lat[i].2),
            t.client_us_per_call(),
            t.redis_us_per_call(),
            def.what
        );
    }

    println!("(client µs, redis µs: CPU time per call of this process and of redis-server)");

    let t = &*totals;
    let fresh_ratio = ratio(rate(t, "idem_fresh"), rate(t, "floor_fresh"));
    let fresh_ratio_c1 = ratio(rate(t, "idem_fresh_c1"), rate(t, "floor_fresh_c1"));
    let replay_ratio = ratio(rate(t, "idem_replay"), rate(t, "floor_replay"));
    let cache_ratio = ratio(rate(t, "cached_replay"), rate(t, "floor_replay"));
    let macro_ratio = ratio(rate(t, "idem_fresh"), rate(t, "hand_fresh"));
    let p50_gap = p("idem_fresh_c1", 50) - p("floor_fresh_c1", 50);
    let bytes_overhead = mem.idem_bytes - mem.plain_bytes;

    println!(
        "\n{:<30} {:>9} {:>25}  target",
        "ratio (totals)", "value", "per round: min / med / max"
    );
    let line = |name: &str, v: f64, a: &str, b: &str, target: &str, ok: bool| {
        if !v.is_finite() {
            return;
        }
        let range = spread(&t[idx(a)], &t[idx(b)]).map_or("-".to_owned(), |(lo, mid, hi)| {
            format!("{lo:.3} / {mid:.3} / {hi:.3}")
        });
        println!(
            "{name:<30} {v:>9.3} {range:>25}  {target} {}",
            if ok { "ok" } else { "MISSED" }
        );
    };
    line(
        "fresh_ratio (c=N)",
        fresh_ratio,
        "idem_fresh",
        "floor_fresh",
        ">= 0.90",
        fresh_ratio >= 0.90,
    );
    line(
        "fresh_ratio_c1",
        fresh_ratio_c1,
        "idem_fresh_c1",
        "floor_fresh_c1",
        ">= 0.90",
        fresh_ratio_c1 >= 0.90,
    );
    line(
        "replay_ratio",
        replay_ratio,
        "idem_replay",
        "floor_replay",
        ">= 0.90",
        replay_ratio >= 0.90,
    );
    line(
        "cache_ratio",
        cache_ratio,
        "cached_replay",
        "floor_replay",
        ">= 10",
        cache_ratio >= 10.0,
    );
    line(
        "macro_ratio (macro / by hand)",
        macro_ratio,
        "idem_fresh",
        "hand_fresh",
        "0.98..1.02",
        (0.98..=1.02).contains(&macro_ratio),
    );
    if p50_gap.is_finite() {
        println!(
            "{:<30} {:>9.1} {:>17}  <= 20 µs {}",
            "p50 gap idem - floor (c=1) µs",
            p50_gap,
            "",
            if p50_gap <= 20.0 { "ok" } else { "MISSED" }
        );
    }
    println!(
        "\nbytes per record ({}-byte key, 64-byte value): idem {} (STRLEN {}), plain string {} (STRLEN {}), \
         plain with PX {}; overhead {} bytes (target <= 24) {}; with a fingerprint: {} bytes",
        mem.key_len,
        mem.idem_bytes,
        mem.idem_strlen,
        mem.plain_bytes,
        mem.plain_strlen,
        mem.plain_px_bytes,
        bytes_overhead,
        if bytes_overhead <= 24 { "ok" } else { "MISSED" },
        mem.idem_fp_bytes
    );
    println!(
        "compression, {}-byte repetitive JSON: record {} bytes (STRLEN {}) plain, {} bytes (STRLEN {}) with compress_above(1024); \
         fresh call p50 {:.1} vs {:.1} µs, replay p50 {:.1} vs {:.1} µs",
        mem.big_json_len,
        mem.big_plain_bytes,
        mem.big_plain_strlen,
        mem.big_lz4_bytes,
        mem.big_lz4_strlen,
        p("big_fresh", 50),
        p("big_fresh_lz4", 50),
        p("big_replay", 50),
        p("big_replay_lz4", 50),
    );
    if errors > 0 {
        println!("{errors} calls failed (first ones printed on stderr)");
    }

    if opts.json {
        let mut phases = serde_json::Map::new();
        for (i, def) in PHASES.iter().enumerate() {
            let t = &t[i];
            if t.ops == 0 && t.secs == 0.0 {
                continue;
            }
            let mut m = serde_json::Map::new();
            m.insert("ops_per_s".into(), round1(t.rate()));
            m.insert("calls".into(), json!(t.ops));
            m.insert(
                "per_round_ops_per_s".into(),
                json!(t.per_round.iter().map(|r| r.round()).collect::<Vec<_>>()),
            );
            m.insert(
                "concurrency".into(),
                json!(def.concurrency.unwrap_or(opts.concurrency)),
            );
            m.insert(
                "client_cpu_us_per_call".into(),
                round3(t.client_us_per_call()),
            );
            m.insert(
                "redis_cpu_us_per_call".into(),
                round3(t.redis_us_per_call()),
            );
            if let (Some(p50), Some(p99)) = (lat[i].1, lat[i].2) {
                m.insert("p50_us".into(), round1(p50));
                m.insert("p99_us".into(), round1(p99));
            }
            phases.insert(def.name.into(), serde_json::Value::Object(m));
        }
        let out = json!({
            "concurrency": opts.concurrency,
            "seconds_per_phase": opts.seconds,
            "rounds": opts.rounds,
            "tokio_workers": opts.threads,
            "floor_fresh_ops": round1(rate(t, "floor_fresh")),
            "idem_fresh_ops": round1(rate(t, "idem_fresh")),
            "hand_fresh_ops": round1(rate(t, "hand_fresh")),
            "floor_replay_ops": round1(rate(t, "floor_replay")),
            "idem_replay_ops": round1(rate(t, "idem_replay")),
            "cached_replay_ops": round1(rate(t, "cached_replay")),
            "floor_fresh_c1_ops": round1(rate(t, "floor_fresh_c1")),
            "idem_fresh_c1_ops": round1(rate(t, "idem_fresh_c1")),
            "floor_fresh_c1_p50_us": round1(p("floor_fresh_c1", 50)),
            "floor_fresh_c1_p99_us": round1(p("floor_fresh_c1", 99)),
            "idem_fresh_c1_p50_us": round1(p("idem_fresh_c1", 50)),
            "idem_fresh_c1_p99_us": round1(p("idem_fresh_c1", 99)),
            "p50_gap_us": round1(p50_gap),
            "idem_bytes": mem.idem_bytes,
            "plain_bytes": mem.plain_bytes,
            "plain_px_bytes": mem.plain_px_bytes,
            "idem_fingerprint_bytes": mem.idem_fp_bytes,
            "bytes_overhead": bytes_overhead,
            "fresh_ratio": round3(fresh_ratio),
            "fresh_ratio_c1": round3(fresh_ratio_c1),
            "replay_ratio": round3(replay_ratio),
            "cache_ratio": round3(cache_ratio),
            "macro_ratio": round3(macro_ratio),
            "compression": {
                "json_bytes": mem.big_json_len,
                "plain_record_bytes": mem.big_plain_bytes,
                "lz4_record_bytes": mem.big_lz4_bytes,
                "plain_strlen": mem.big_plain_strlen,
                "lz4_strlen": mem.big_lz4_strlen,
                "fresh_p50_us": round1(p("big_fresh", 50)),
                "fresh_lz4_p50_us": round1(p("big_fresh_lz4", 50)),
                "replay_p50_us": round1(p("big_replay", 50)),
                "replay_lz4_p50_us": round1(p("big_replay_lz4", 50)),
                "fresh_ops": round1(rate(t, "big_fresh")),
                "fresh_lz4_ops": round1(rate(t, "big_fresh_lz4")),
                "replay_ops": round1(rate(t, "big_replay")),
                "replay_lz4_ops": round1(rate(t, "big_replay_lz4")),
            },
            "per_round": {
                "fresh_ratio": spread_json(&t[idx("idem_fresh")], &t[idx("floor_fresh")]),
                "fresh_ratio_c1": spread_json(&t[idx("idem_fresh_c1")], &t[idx("floor_fresh_c1")]),
                "replay_ratio": spread_json(&t[idx("idem_replay")], &t[idx("floor_replay")]),
                "cache_ratio": spread_json(&t[idx("cached_replay")], &t[idx("floor_replay")]),
                "macro_ratio": spread_json(&t[idx("idem_fresh")], &t[idx("hand_fresh")]),
            },
            "errors": errors,
            "phases": phases,
        });
        println!("{out}");
    }
}

fn format_secs(s: f64) -> String {
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s} s")
    }
}
