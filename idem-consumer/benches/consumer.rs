//! Messages per second through idem against each broker's bare consume+ack
//! loop, in the same run, on the same broker.
//!
//! ```sh
//! cargo bench -p idem-consumer --bench consumer            # every phase
//! cargo bench -p idem-consumer --bench consumer -- redis   # or: core, nats, rabbitmq, kafka, sqs, postgres
//! ```
//!
//! Every phase pre-publishes `MESSAGES` messages (Kafka five times as many:
//! see `consumer/kafka.rs`; SQS a fifth, on moto: `consumer/sqs.rs`) (not
//! timed), then times
//! consuming and acking all of them with batches of 64, three ways on the
//! same broker: the bare consume+ack loop; the dedup floor (`floor.rs`: the
//! bare loop plus the two writes per message any deduplication needs,
//! pipelined per batch, without idem's code); and idem, each message
//! through `Consumer` (claim, no-op handler, stored result) on a private
//! redis-server. The `core-*` phases take ready messages (no broker) on
//! the in-process `MemoryStore` (`core-memory`: idem's own cost, no network;
//! its floor is an in-process set), on Redis and on PostgreSQL (`PgStore`, a
//! database of its own). Loops alternate over 3 rounds (or
//! `IDEM_BENCH_ROUNDS`) and the best round of each is reported. Every timed loop also counts the process's
//! heap allocations (a counting global allocator, `stats_alloc`), printed
//! per message beside the rates (`allocs/msg`: the fewest of the rounds;
//! they include the broker and Redis clients' own), and the CPU time per
//! message of this process and of the private redis-server
//! (`cpu-us/msg`, the least of the rounds; not the brokers', whose work
//! is the same for the floor and for idem): what each message costs the
//! machine, beside how fast the loop went. On a virtual machine whose
//! host steals time both move with the neighbours: compare binaries by
//! instruction counts there (docs/performance.md, "The commands").
//! NATS and RabbitMQ are taken from `NATS_URL` / `AMQP_URL` or their
//! default local ports; SQS is the local AWS endpoint (moto's server,
//! `IDEM_AWS_ENDPOINT` or 127.0.0.1:4566, batches of 10: SQS's most);
//! PostgreSQL as idem-testkit finds it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

use futures_util::StreamExt;
use idem_consumer::nats::{NatsConfig, NatsConsumer, async_nats, pull_config};
use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue, lapin};
use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig, redis};
use idem_consumer::{Adapter, Consumer, Message};
use idem_core::{Idempotency, MemoryStore};
use idem_redis::RedisStore;
use idem_testkit::RedisServer;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use std::alloc::System;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Heap allocations (and reallocations) so far, process-wide.
fn allocations() -> usize {
    let stats = GLOBAL.stats();
    stats.allocations + stats.reallocations
}

/// The allocations per message of the last timed loop (f64 bits).
static LAST_ALLOCS: AtomicU64 = AtomicU64::new(0);

fn last_allocs() -> f64 {
    f64::from_bits(LAST_ALLOCS.load(Ordering::SeqCst))
}

/// CPU µs per message of the last timed loop (see [`cpu_seconds`]).
static LAST_CPU: AtomicU64 = AtomicU64::new(0);

fn last_cpu() -> f64 {
    f64::from_bits(LAST_CPU.load(Ordering::SeqCst))
}

/// The private redis-server's pid, once started (0: not counted).
static REDIS_PID: AtomicU32 = AtomicU32::new(0);

/// CPU time so far of this process's threads and of the private
/// redis-server's, in seconds. The brokers' own CPU is not in it: it is
/// the same work for the floor and for idem.
fn cpu_seconds() -> f64 {
    let pid = REDIS_PID.load(Ordering::SeqCst);
    let redis = if pid == 0 {
        0.0
    } else {
        idem_testkit::process_cpu(&pid.to_string())
    };
    idem_testkit::process_cpu("self") + redis
}

/// A timed loop over `MESSAGES` messages: its rate, and (kept for
/// [`last_allocs`]) its allocations per message.
struct Timer {
    start: Instant,
    allocs: usize,
    cpu: f64,
}

impl Timer {
    fn start() -> Timer {
        // The clock last: reading the CPU times walks /proc (every thread
        // of two processes), which took a millisecond or more and, inside
        // the timed span, halved core-memory's rate (a 4 ms loop).
        let (allocs, cpu) = (allocations(), cpu_seconds());
        Timer {
            start: Instant::now(),
            allocs,
            cpu,
        }
    }

    /// Messages per second since the start, over a loop of `MESSAGES`;
    /// records allocations per message.
    fn rate(&self) -> f64 {
        self.rate_of(MESSAGES)
    }

    /// [`rate`](Timer::rate) of a loop over `n` messages.
    fn rate_of(&self, n: usize) -> f64 {
        let elapsed = self.start.elapsed().as_secs_f64();
        let allocs = allocations().saturating_sub(self.allocs) as f64 / n as f64;
        LAST_ALLOCS.store(allocs.to_bits(), Ordering::SeqCst);
        let cpu = (cpu_seconds() - self.cpu) * 1e6 / n as f64;
        LAST_CPU.store(cpu.to_bits(), Ordering::SeqCst);
        n as f64 / elapsed
    }
}

#[path = "consumer/floor.rs"]
mod floor;
#[path = "consumer/kafka.rs"]
mod kafka;
#[path = "consumer/sqs.rs"]
mod sqs;

use floor::{PgFloor, RedisFloor};

const MESSAGES: usize = 5_000;
/// Rounds per phase: 3, or `IDEM_BENCH_ROUNDS` (more on a busy machine).
fn rounds() -> usize {
    std::env::var("IDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(3)
}
const BATCH: usize = 64;

fn payload(run: usize, i: usize) -> String {
    format!(r#"{{"order":"o-{run}-{i}","amount":{i}}}"#)
}

async fn consumer(redis_url: &str, run: usize) -> Consumer {
    let store = RedisStore::connect(redis_url).await.expect("idem store");
    let idem = Idempotency::builder(store)
        .namespace(format!("bench{run}"))
        .build();
    Consumer::new(idem, "bench").concurrency(BATCH)
}

async fn noop(_: Message) -> Result<(), String> {
    Ok(())
}

// ------------------------------------------------------------ Redis Streams

async fn redis_publish(c: &mut redis::aio::MultiplexedConnection, stream: &str, run: usize) {
    for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(500) {
        let mut pipe = redis::pipe();
        for &i in chunk {
            pipe.cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("id")
                .arg(format!("m{i}"))
                .arg("payload")
                .arg(payload(run, i))
                .ignore();
        }
        let _: () = pipe.query_async(c).await.expect("XADD");
    }
    let _: Result<(), _> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg("g")
        .arg("0")
        .query_async(c)
        .await;
}

async fn redis_bare(url: &str, run: usize, floor: Option<&RedisFloor>) -> f64 {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream = format!("{}{run}", if floor.is_some() { "floor" } else { "bare" });
    redis_publish(&mut c, &stream, run).await;
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(BATCH)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(&mut c)
            .await
            .unwrap();
        let ids: Vec<String> = reply
            .keys
            .into_iter()
            .flat_map(|k| k.ids)
            .map(|i| i.id)
            .collect();
        done += ids.len();
        if let Some(floor) = floor {
            floor.dedup(&ids).await;
        }
        let _: usize = redis::cmd("XACK")
            .arg(&stream)
            .arg("g")
            .arg(&ids)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    start.rate()
}

async fn redis_idem(url: &str, run: usize) -> f64 {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream = format!("idem{run}");
    redis_publish(&mut c, &stream, run).await;
    let consumer = consumer(url, run).await;
    let s = RedisStreamsConsumer::connect(
        url,
        StreamsConfig::new(&stream, "g", "c")
            .batch(BATCH)
            .block(Duration::from_millis(10)),
    )
    .await
    .unwrap();
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        done += s.poll(&consumer, &noop).await.unwrap().acked;
    }
    start.rate()
}

// ------------------------------------------------------------------- NATS

async fn nats_setup(
    js: &async_nats::jetstream::Context,
    run: usize,
    tag: &str,
) -> (String, async_nats::jetstream::consumer::PullConsumer) {
    let name = format!("IDEM_BENCH_{tag}_{}_{run}", std::process::id());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .expect("create stream (is JetStream on?)");
    let mut acks = Vec::with_capacity(MESSAGES);
    for i in 0..MESSAGES {
        acks.push(
            js.publish(format!("{name}.in"), payload(run, i).into())
                .await
                .unwrap(),
        );
    }
    for a in acks {
        a.await.unwrap();
    }
    let pull = stream
        .create_consumer(pull_config("bench", Duration::from_secs(30)))
        .await
        .unwrap();
    (name, pull)
}

async fn nats_bare(
    js: &async_nats::jetstream::Context,
    run: usize,
    floor: Option<&RedisFloor>,
) -> f64 {
    let tag = if floor.is_some() { "FLOOR" } else { "BARE" };
    let (name, pull) = nats_setup(js, run, tag).await;
    let start = Timer::start();
    let msgs = pull
        .stream()
        .max_messages_per_batch(BATCH)
        .messages()
        .await
        .unwrap();
    let mut done = 0;
    match floor {
        None => {
            let mut msgs = msgs;
            while done < MESSAGES {
                let m = msgs.next().await.unwrap().unwrap();
                m.ack().await.unwrap();
                done += 1;
            }
        }
        // What the stream has ready, up to a batch: deduplicated, then acked.
        Some(floor) => {
            let mut batches = msgs.ready_chunks(BATCH);
            while done < MESSAGES {
                let batch: Vec<_> = batches
                    .next()
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|m| m.unwrap())
                    .collect();
                let keys: Vec<&[u8]> = batch.iter().map(|m| &m.payload[..]).collect();
                floor.dedup(&keys).await;
                for m in &batch {
                    m.ack().await.unwrap();
                }
                done += batch.len();
            }
        }
    }
    let rate = start.rate();
    js.delete_stream(&name).await.unwrap();
    rate
}

async fn nats_idem(js: &async_nats::jetstream::Context, redis_url: &str, run: usize) -> f64 {
    let (name, pull) = nats_setup(js, run, "IDEM").await;
    let consumer = consumer(redis_url, run).await;
    let n = NatsConsumer::new(
        pull,
        NatsConfig::new()
            .batch(BATCH)
            .block(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        done += n.poll(&consumer, &noop).await.unwrap().acked;
    }
    let rate = start.rate();
    js.delete_stream(&name).await.unwrap();
    rate
}

// --------------------------------------------------------------- RabbitMQ

async fn rabbit_setup(conn: &lapin::Connection, run: usize, tag: &str) -> (lapin::Channel, String) {
    let ch = conn.create_channel().await.unwrap();
    let q = format!("idem.bench.{tag}.{}.{run}", std::process::id());
    declare_queue(&ch, &q, &format!("{q}.dlx"), &format!("{q}.dead"))
        .await
        .unwrap();
    for i in 0..MESSAGES {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            payload(run, i).as_bytes(),
            Default::default(),
        )
        .await
        .unwrap();
    }
    // Wait until the broker holds them all, so consuming is what is timed.
    loop {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let n = ch
            .queue_declare(q.as_str().into(), passive, Default::default())
            .await
            .unwrap()
            .message_count();
        if n as usize >= MESSAGES {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (ch, q)
}

async fn rabbit_cleanup(ch: &lapin::Channel, q: &str) {
    for name in [q.to_owned(), format!("{q}.dead")] {
        let _ = ch
            .queue_delete(name.as_str().into(), Default::default())
            .await;
    }
    let _ = ch
        .exchange_delete(format!("{q}.dlx").as_str().into(), Default::default())
        .await;
}

async fn rabbit_bare(amqp: &str, run: usize, floor: Option<&RedisFloor>) -> f64 {
    let conn = &rabbit_connect(amqp).await;
    let (ch, q) = rabbit_setup(conn, run, if floor.is_some() { "floor" } else { "bare" }).await;
    let c = conn.create_channel().await.unwrap();
    c.basic_qos(BATCH as u16, Default::default()).await.unwrap();
    let mut deliveries = c
        .basic_consume(
            q.as_str().into(),
            "".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let start = Timer::start();
    match floor {
        None => {
            for _ in 0..MESSAGES {
                let d = deliveries.next().await.unwrap().unwrap();
                d.acker.ack(Default::default()).await.unwrap();
            }
        }
        // What the channel has ready, up to a batch: deduplicated, then acked.
        Some(floor) => {
            let mut batches = deliveries.ready_chunks(BATCH);
            let mut done = 0;
            while done < MESSAGES {
                let batch: Vec<_> = batches
                    .next()
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|d| d.unwrap())
                    .collect();
                let keys: Vec<&[u8]> = batch.iter().map(|d| &d.data[..]).collect();
                floor.dedup(&keys).await;
                for d in &batch {
                    d.acker.ack(Default::default()).await.unwrap();
                }
                done += batch.len();
            }
        }
    }
    let rate = start.rate();
    rabbit_cleanup(&ch, &q).await;
    rate
}

/// A connection of the round's own. lapin 4.12.3 has now and then (about
/// one bench run in five, with one connection for every round) closed the
/// connection with `UNEXPECTED-FRAME: unexpected basic cancel-ok` after a
/// round's consumer was dropped, which ended the whole bench.
async fn rabbit_connect(amqp: &str) -> lapin::Connection {
    lapin::Connection::connect(amqp, Default::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {amqp}: {e}"))
}

async fn rabbit_idem(amqp: &str, redis_url: &str, run: usize) -> f64 {
    let conn = &rabbit_connect(amqp).await;
    let (ch, q) = rabbit_setup(conn, run, "idem").await;
    let consumer = consumer(redis_url, run)
        .await
        .keys(idem_consumer::KeySource::Payload(Default::default()));
    let r = RabbitConsumer::new(
        conn.create_channel().await.unwrap(),
        RabbitConfig::new(&q)
            .prefetch(BATCH as u16)
            .block(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        done += r.poll(&consumer, &noop).await.unwrap().acked;
    }
    let rate = start.rate();
    rabbit_cleanup(&ch, &q).await;
    rate
}

// ------------------------------------------------------------- core alone

fn ready_messages(run: usize) -> Vec<Message> {
    (0..MESSAGES)
        .map(|i| Message::new(payload(run, i)).with_id(format!("m{i}")))
        .collect()
}

/// The core with no broker: batches of ready messages through idem.
async fn core_idem(consumer: &Consumer, run: usize) -> f64 {
    let msgs = ready_messages(run);
    let start = Timer::start();
    for chunk in msgs.chunks(BATCH) {
        let out = consumer.handle_batch(chunk, &noop).await;
        assert!(out.iter().all(|h| h.decision.is_ack()));
    }
    start.rate()
}

/// The core's floor: the same batches, deduplicated without idem.
async fn core_floor<F, Fut>(run: usize, dedup: F) -> f64
where
    F: Fn(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    let msgs = ready_messages(run);
    let start = Timer::start();
    for chunk in msgs.chunks(BATCH) {
        let keys = chunk
            .iter()
            .map(|m| String::from_utf8_lossy(m.payload()).into_owned())
            .collect();
        assert_eq!(dedup(keys).await, chunk.len());
    }
    start.rate()
}

// ------------------------------------------------------------------- main

/// One line per phase, in the form earlier versions printed plus the floor:
/// `ratio` is idem against the bare loop, `of-floor` idem against the floor;
/// then the allocations per message of the floor and of idem, and their
/// CPU µs per message (this process and the private redis-server; the
/// fewest of the rounds).
fn report(phase: &str, bare: Option<&[f64]>, floor: &Runs, idem: &Runs) {
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (f, i) = (best(&floor.rates), best(&idem.rates));
    let (bare, ratio) = match bare {
        Some(b) => (format!("{:>8.0}", best(b)), format!("{:.2}", i / best(b))),
        None => (format!("{:>8}", "-"), "-".to_owned()),
    };
    println!(
        "{phase:<14} bare {bare} msg/s  floor {f:>8.0} msg/s  idem {i:>8.0} msg/s  ratio {ratio}  of-floor {:.2}  allocs/msg floor {:.1} idem {:.1}  cpu-us/msg floor {:.2} idem {:.2}",
        i / f,
        floor.allocs(),
        idem.allocs(),
        floor.cpu(),
        idem.cpu(),
    );
}

/// The rounds of one loop: rates, and allocations per message.
#[derive(Default)]
struct Runs {
    rates: Vec<f64>,
    allocs: Vec<f64>,
    cpu: Vec<f64>,
}

impl Runs {
    /// Adds a round: its rate, with the allocations and CPU its timer
    /// recorded.
    fn push(&mut self, rate: f64) {
        self.push_with(Sample::last(rate));
    }

    /// Adds a round measured elsewhere.
    fn push_with(&mut self, s: Sample) {
        self.rates.push(s.rate);
        self.allocs.push(s.allocs);
        self.cpu.push(s.cpu);
    }

    fn allocs(&self) -> f64 {
        self.allocs.iter().copied().fold(f64::INFINITY, f64::min)
    }

    fn cpu(&self) -> f64 {
        self.cpu.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// One timed loop: messages per second, allocations and CPU µs per message.
#[derive(Clone, Copy)]
struct Sample {
    rate: f64,
    allocs: f64,
    cpu: f64,
}

impl Sample {
    /// The last timed loop's, at `rate`.
    fn last(rate: f64) -> Sample {
        Sample {
            rate,
            allocs: last_allocs(),
            cpu: last_cpu(),
        }
    }
}

fn main() {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |b: &str| only.is_empty() || only.iter().any(|o| b.contains(o.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start();
    REDIS_PID.store(server.pid().unwrap_or(0), Ordering::SeqCst);
    let url = server.url();
    println!(
        "{MESSAGES} messages per phase (kafka {}, sqs {}), batches of {BATCH} (sqs 10), best of {} alternating rounds; \
         floor = the bare loop + one pipelined SET NX and one SET per message (benches/consumer/floor.rs)",
        kafka::MESSAGES,
        sqs::MESSAGES,
        rounds()
    );
    rt.block_on(async {
        let mut run = 0;
        if wanted("core-memory") {
            let (mut floor, mut idem) = (Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                let seen = Mutex::new(std::collections::HashSet::new());
                floor.push(
                    core_floor(run, |keys| {
                        let fresh = {
                            let mut seen = seen.lock().unwrap();
                            keys.into_iter().filter(|k| seen.insert(k.clone())).count()
                        };
                        std::future::ready(fresh)
                    })
                    .await,
                );
                let idem_memory = Idempotency::builder(MemoryStore::new())
                    .namespace(format!("bench{run}"))
                    .build();
                let c = Consumer::new(idem_memory, "bench").concurrency(BATCH);
                idem.push(core_idem(&c, run).await);
            }
            report("core-memory", None, &floor, &idem);
        }
        if wanted("core-redis") {
            let (mut floor, mut idem) = (Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                let f = RedisFloor::connect(&url, run).await;
                floor.push(
                    core_floor(run, |keys| {
                        let f = f.clone();
                        async move { f.dedup(&keys).await }
                    })
                    .await,
                );
                idem.push(core_idem(&consumer(&url, run).await, run).await);
            }
            report("core-redis", None, &floor, &idem);
        }
        if wanted("core-postgres") {
            let ctx = idem_testkit::TestContext::postgres().await;
            let pg = PgFloor::new(ctx.pg_db().pool.clone()).await;
            let (mut floor, mut idem) = (Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                floor.push(core_floor(run, |keys| pg.dedup_owned(keys)).await);
                let c = Consumer::new(
                    ctx.idem_with(|b| b.namespace(format!("bench{run}"))),
                    "bench",
                )
                .concurrency(BATCH);
                idem.push(core_idem(&c, run).await);
            }
            report("core-postgres", None, &floor, &idem);
        }
        if wanted("redis-streams") {
            let (mut bare, mut floor, mut idem) = (Vec::new(), Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                bare.push(redis_bare(&url, run, None).await);
                let f = RedisFloor::connect(&url, run).await;
                floor.push(redis_bare(&url, run, Some(&f)).await);
                idem.push(redis_idem(&url, run).await);
            }
            report("redis-streams", Some(&bare), &floor, &idem);
        }
        if wanted("nats") {
            let nats_url =
                std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
            let js = async_nats::jetstream::new(
                async_nats::connect(&nats_url)
                    .await
                    .unwrap_or_else(|e| panic!("NATS at {nats_url}: {e}")),
            );
            let (mut bare, mut floor, mut idem) = (Vec::new(), Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                bare.push(nats_bare(&js, run, None).await);
                let f = RedisFloor::connect(&url, run).await;
                floor.push(nats_bare(&js, run, Some(&f)).await);
                idem.push(nats_idem(&js, &url, run).await);
            }
            report("nats", Some(&bare), &floor, &idem);
        }
        if wanted("rabbitmq") {
            let amqp = std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let (mut bare, mut floor, mut idem) = (Vec::new(), Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                bare.push(rabbit_bare(&amqp, run, None).await);
                let f = RedisFloor::connect(&url, run).await;
                floor.push(rabbit_bare(&amqp, run, Some(&f)).await);
                idem.push(rabbit_idem(&amqp, &url, run).await);
            }
            report("rabbitmq", Some(&bare), &floor, &idem);
        }
        if wanted("kafka") {
            let broker = idem_testkit::KafkaBroker::start();
            let (mut bare, mut floor, mut idem) = (Vec::new(), Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                let (b, f, i) = kafka::round(&broker, &url, run).await;
                bare.push(b);
                floor.push_with(f);
                idem.push_with(i);
            }
            report("kafka", Some(&bare), &floor, &idem);
        }
        if wanted("sqs") {
            let client = idem_testkit::sqs_client().await;
            let (mut bare, mut floor, mut idem) = (Vec::new(), Runs::default(), Runs::default());
            for _ in 0..rounds() {
                run += 1;
                bare.push(sqs::bare(&client, run, None).await);
                let f = RedisFloor::connect(&url, run).await;
                floor.push(sqs::bare(&client, run, Some(&f)).await);
                idem.push(sqs::idem(&client, &url, run).await);
            }
            report("sqs", Some(&bare), &floor, &idem);
        }
    });
}
