//! What tracing with OpenTelemetry costs idem: the same workloads in three
//! states, in the same run, rounds interleaved (the states' order rotates
//! from round to round), the median time per operation:
//!
//! - **off**: no subscriber at all, the tracing max level `OFF` (asserted):
//!   what a user without tracing pays, idem's `level_enabled!` checks and
//!   no span built;
//! - **tracing**: `tracing_subscriber::registry()` behind an `INFO` level
//!   filter, no layer: the spans alone (the registry's slab, the span
//!   stack, no formatting, no I/O);
//! - **otel**: the same registry and filter with `tracing_opentelemetry`'s
//!   layer (its defaults) over an `opentelemetry_sdk` `SdkTracerProvider`
//!   (default sampler: every span sampled) whose exporter counts spans and
//!   drops them. The processor is the batch one by default, as an OTLP
//!   service runs it (the caller pays a channel send per span; the export
//!   runs on the processor's thread); its queue holds 65,536 spans so that
//!   none is dropped (a dropped span would be cheaper; the report checks
//!   the count). `--processor simple` exports each span on the caller's
//!   thread instead.
//!
//! The workloads, each a fresh key per operation:
//!
//! 1. **memory**: `idem.call("op", key).run(..)` on a new `MemoryStore`
//!    per measurement: one span (`idem.call`);
//! 2. **redis**: the same call on `RedisStore` (`REDIS_URL`, default
//!    `redis://127.0.0.1:6379`): one span against a network round trip;
//!    its floor, a bare `SET NX PX` then `SET XX KEEPTTL` by redis-rs on a
//!    `ConnectionManager`, is timed in the same rounds;
//! 3. **consumer**: `Consumer::handle` of a `Message` with an id and a
//!    `traceparent` header, on `MemoryStore`: two spans (`idem.consume`,
//!    the `process` span linked to the producer's, and `idem.call`);
//! 4. **outbox**: a call on `RedisStore` whose body stages one message
//!    (`outbox::stage`): two spans (`idem.call`, and `create`, whose W3C
//!    context is written into the message's headers).
//!
//! ```text
//! cargo bench --bench otel --features otel,consumer,redis -- --calls 2000 --rounds 5
//! cargo bench --bench otel --features otel,consumer,redis -- --processor simple
//! ```
//!
//! Instructions (callgrind, which the machine's load does not move): one
//! state's memory calls alone, at two call counts, the slope per call:
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/deps/otel-* --profile otel --calls 4000
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

use idem::consumer::{Consumer, Decision, Message};
use idem::{Error, Idempotency, MemoryStore, Outcome, RedisStore};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
};
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tracing::Dispatch;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;

/// The producer's context a consumed message carries (sampled).
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// Idem's records and the floor's keys expire (the bench leaves nothing).
const TTL: Duration = Duration::from_secs(300);

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn arg_usize(name: &str, default: usize) -> usize {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum State {
    Off,
    Tracing,
    Otel,
}

const STATES: [State; 3] = [State::Off, State::Tracing, State::Otel];

impl State {
    fn parse(s: &str) -> State {
        match s {
            "off" => State::Off,
            "tracing" => State::Tracing,
            "otel" => State::Otel,
            other => panic!("--profile {other}: off, tracing or otel"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Workload {
    Memory,
    Redis,
    /// The bare SET pair under the Redis workload (timed with no subscriber).
    Floor,
    Consumer,
    Outbox,
}

impl Workload {
    fn what(self) -> &'static str {
        match self {
            Workload::Memory => "fresh call, MemoryStore",
            Workload::Redis => "fresh call, RedisStore",
            Workload::Floor => "floor: SET NX PX + SET XX (redis-rs)",
            Workload::Consumer => "consumed message (traceparent), MemoryStore",
            Workload::Outbox => "fresh call staging 1 outbox message, RedisStore",
        }
    }
}

/// An exporter that counts the spans it is handed and drops them.
#[derive(Debug, Clone, Default)]
struct CountingExporter(Arc<AtomicUsize>);

impl SpanExporter for CountingExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.fetch_add(batch.len(), Ordering::Relaxed);
        Ok(())
    }
}

struct Otel {
    provider: SdkTracerProvider,
    exported: Arc<AtomicUsize>,
}

impl Otel {
    fn new(processor: &str) -> Otel {
        let exporter = CountingExporter::default();
        let exported = exporter.0.clone();
        let builder = SdkTracerProvider::builder();
        let provider = match processor {
            "batch" => builder.with_span_processor(
                BatchSpanProcessor::builder(exporter)
                    .with_batch_config(
                        BatchConfigBuilder::default()
                            .with_max_queue_size(1 << 16)
                            .build(),
                    )
                    .build(),
            ),
            "simple" => builder.with_simple_exporter(exporter),
            other => panic!("--processor {other}: batch or simple"),
        }
        .build();
        Otel { provider, exported }
    }

    /// Every span ended so far, exported (counted).
    fn exported(&self) -> usize {
        self.provider.force_flush().unwrap();
        self.exported.load(Ordering::Relaxed)
    }

    /// The subscriber of `state`: `None` is no subscriber at all. Made
    /// anew for each measurement, after the previous one's is dropped: a
    /// dispatcher alive anywhere keeps tracing's max level at its own.
    fn dispatch(&self, state: State) -> Option<Dispatch> {
        match state {
            State::Off => {
                // Registering a dispatcher recomputes the max level from the
                // live ones: this one, OFF, alone (the others are dropped).
                drop(Dispatch::new(
                    tracing_subscriber::registry().with(LevelFilter::OFF),
                ));
                None
            }
            State::Tracing => Some(Dispatch::new(
                tracing_subscriber::registry().with(LevelFilter::INFO),
            )),
            State::Otel => Some(Dispatch::new(
                tracing_subscriber::registry().with(LevelFilter::INFO).with(
                    tracing_opentelemetry::layer().with_tracer(self.provider.tracer("bench")),
                ),
            )),
        }
    }
}

/// Runs `fut` on `rt` (current-thread: the thread's default subscriber is
/// the one every poll sees) in `state`.
fn in_state<T>(rt: &Runtime, otel: &Otel, state: State, fut: impl Future<Output = T>) -> T {
    let dispatch = otel.dispatch(state);
    let _default = dispatch.as_ref().map(tracing::dispatcher::set_default);
    let expected = match state {
        State::Off => LevelFilter::OFF,
        State::Tracing | State::Otel => LevelFilter::INFO,
    };
    assert_eq!(LevelFilter::current(), expected, "{state:?}");
    rt.block_on(fut)
}

struct RedisSide {
    idem: Idempotency,
    /// The same store with an outbox of the run's own (deleted at the end).
    outbox_idem: Idempotency,
    outbox_stream: String,
    conn: ConnectionManager,
}

impl RedisSide {
    async fn connect(url: &str, run: &str) -> Result<RedisSide, String> {
        let store = RedisStore::connect(url).await.map_err(|e| e.to_string())?;
        let outbox_stream = format!("idem-bench-otel-{run}");
        let outbox_store = store
            .clone()
            .with_outbox_prefix(&outbox_stream)
            .map_err(|e| e.to_string())?;
        let build = |s: RedisStore| {
            Idempotency::builder(s)
                .namespace(format!("bench-otel-{run}"))
                .result_ttl(TTL)
                .build()
        };
        let client = redis::Client::open(url).map_err(|e| e.to_string())?;
        let conn = ConnectionManager::new(client)
            .await
            .map_err(|e| e.to_string())?;
        Ok(RedisSide {
            idem: build(store),
            outbox_idem: build(outbox_store),
            outbox_stream,
            conn,
        })
    }

    async fn clean_up(&mut self) {
        let s = &self.outbox_stream;
        let _: () = redis::cmd("DEL")
            .arg(s)
            .arg(format!("{s}.parked"))
            .arg(format!("{s}.relay"))
            .arg(format!("{s}.streams"))
            .query_async(&mut self.conn)
            .await
            .unwrap();
    }
}

/// `calls` operations of `workload`, keys `{tag}-{i}` (`tag` names the
/// run, the workload, the round and the state: the Redis workloads share a
/// namespace, and a key seen before would replay): the time they took.
async fn timed(w: Workload, redis: Option<&RedisSide>, tag: &str, calls: usize) -> Duration {
    let body = || async { Ok::<_, Error>(1u32) };
    match w {
        Workload::Memory => {
            let idem = Idempotency::builder(MemoryStore::new()).build();
            let t = Instant::now();
            for i in 0..calls {
                let v = idem
                    .call("op", format!("{tag}-{i}"))
                    .run_outcome(body)
                    .await;
                assert_eq!(v.unwrap(), (1, Outcome::Executed));
            }
            t.elapsed()
        }
        Workload::Redis => {
            let idem = &redis.unwrap().idem;
            let t = Instant::now();
            for i in 0..calls {
                let v = idem
                    .call("op", format!("{tag}-{i}"))
                    .run_outcome(body)
                    .await;
                assert_eq!(v.unwrap(), (1, Outcome::Executed));
            }
            t.elapsed()
        }
        Workload::Floor => {
            let mut conn = redis.unwrap().conn.clone();
            let ttl_ms = TTL.as_millis() as u64;
            let t = Instant::now();
            for i in 0..calls {
                let key = format!("bench-otel-floor:{tag}-{i}");
                let claimed: redis::Value = redis::cmd("SET")
                    .arg(&key)
                    .arg("0123456789abcdef0123456789abcdef")
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(matches!(claimed, redis::Value::Okay), "{claimed:?}");
                let done: redis::Value = redis::cmd("SET")
                    .arg(&key)
                    .arg("1")
                    .arg("XX")
                    .arg("KEEPTTL")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(matches!(done, redis::Value::Okay), "{done:?}");
            }
            t.elapsed()
        }
        Workload::Consumer => {
            let idem = Idempotency::builder(MemoryStore::new()).build();
            let consumer = Consumer::new(idem, "orders.ship");
            let handler = |_m: Message| async { Ok::<_, String>(1u32) };
            let t = Instant::now();
            for i in 0..calls {
                let msg = Message::new("{}")
                    .with_id(format!("{tag}-{i}"))
                    .with_trace_header("traceparent", TRACEPARENT);
                let handled = consumer.handle(&msg, &handler).await;
                assert!(matches!(handled.decision, Decision::Ack));
                assert_eq!(handled.outcome, Some(Outcome::Executed));
            }
            t.elapsed()
        }
        Workload::Outbox => {
            let idem = &redis.unwrap().outbox_idem;
            let t = Instant::now();
            for i in 0..calls {
                let key = format!("{tag}-{i}");
                let v = idem
                    .call("op", &key)
                    .run_outcome(|| async {
                        idem::outbox::stage("bench.orders", &key, &1u32)?;
                        Ok::<_, Error>(1u32)
                    })
                    .await;
                assert_eq!(v.unwrap(), (1, Outcome::Executed));
            }
            t.elapsed()
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn run_id() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    format!("{ms:x}-{}", std::process::id())
}

fn main() {
    let calls = arg_usize("--calls", 2000);
    let rounds = arg_usize("--rounds", 5);
    let processor = arg("--processor").unwrap_or_else(|| "batch".into());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let otel = Otel::new(&processor);
    let run = run_id();

    // Callgrind: the memory workload alone, in one state.
    if let Some(state) = arg("--profile") {
        let state = State::parse(&state);
        in_state(
            &rt,
            &otel,
            state,
            timed(Workload::Memory, None, &run, calls),
        );
        let spans = otel.exported();
        otel.provider.shutdown().unwrap();
        eprintln!("{calls} calls in {state:?}: {spans} spans exported");
        return;
    }

    let url = arg("--redis")
        .or_else(|| std::env::var("REDIS_URL").ok())
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let mut redis = match rt.block_on(RedisSide::connect(&url, &run)) {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!("Redis at {url}: {e}; the Redis workloads are skipped");
            None
        }
    };
    let mut workloads = vec![Workload::Memory, Workload::Consumer];
    if redis.is_some() {
        workloads.extend([Workload::Redis, Workload::Floor, Workload::Outbox]);
    }
    let states_of = |w: Workload| -> &'static [State] {
        match w {
            Workload::Floor => &[State::Off],
            _ => &STATES,
        }
    };

    // Warm up every workload in every state (connections, scripts, caches).
    for &w in &workloads {
        for &s in states_of(w) {
            let tag = format!("{run}-{w:?}-warm-{s:?}");
            in_state(&rt, &otel, s, timed(w, redis.as_ref(), &tag, 200));
        }
    }

    let mut micros: HashMap<(Workload, State), Vec<f64>> = HashMap::new();
    let mut spans: HashMap<Workload, (usize, usize)> = HashMap::new();
    for round in 0..rounds {
        for &w in &workloads {
            let states = states_of(w);
            for k in 0..states.len() {
                let s = states[(round + k) % states.len()];
                let before = otel.exported();
                let tag = format!("{run}-{w:?}-{round}-{s:?}");
                let took = in_state(&rt, &otel, s, timed(w, redis.as_ref(), &tag, calls));
                let exported = otel.exported() - before;
                if s == State::Otel {
                    let e = spans.entry(w).or_default();
                    e.0 += exported;
                    e.1 += calls;
                } else {
                    assert_eq!(exported, 0, "{w:?} in {s:?} exported spans");
                }
                micros
                    .entry((w, s))
                    .or_default()
                    .push(took.as_secs_f64() * 1e6 / calls as f64);
            }
        }
    }
    if let Some(r) = redis.as_mut() {
        rt.block_on(r.clean_up());
    }
    otel.provider.shutdown().unwrap();

    let m = |w: Workload, s: State| median(micros[&(w, s)].clone());
    println!(
        "{calls} sequential operations per state and round, median of {rounds} rounds, \
         current-thread runtime; otel: {processor} span processor, an exporter that drops spans"
    );
    println!(
        "| workload | spans/op | off µs/op | tracing µs/op | otel µs/op | otel − off µs | otel − off |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &w in &workloads {
        if w == Workload::Floor {
            println!("| {} | 0 | {:.2} | | | | |", w.what(), m(w, State::Off));
            continue;
        }
        let (off, tr, ot) = (m(w, State::Off), m(w, State::Tracing), m(w, State::Otel));
        let (exported, n) = spans[&w];
        println!(
            "| {} | {:.2} | {off:.2} | {tr:.2} | {ot:.2} | {:+.2} | {:+.1}% |",
            w.what(),
            exported as f64 / n as f64,
            ot - off,
            (ot - off) / off * 100.0
        );
    }
    if redis.is_some() {
        println!(
            "RedisStore at {url}; idem (off) / floor: {:.2}",
            m(Workload::Redis, State::Off) / m(Workload::Floor, State::Off)
        );
    }
}
