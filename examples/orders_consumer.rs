//! Charges each order once, whatever the broker redelivers.
//!
//! Two modes, on Redis Streams (default), NATS JetStream (`NATS_URL`),
//! RabbitMQ (`AMQP_URL`) or Kafka (`KAFKA_BROKERS`, demo only):
//!
//! - **demo** (no arguments): publishes its own order events with
//!   duplicates (the same id twice), a re-publish (same order, new id and
//!   timestamp), a poison order that can never be charged and a flaky one
//!   that fails its first delivery, consumes them, prints what happened to
//!   each and removes what it created.
//! - **consume** (`consume <stream | queue | subject> [ledger file]`):
//!   consumes an existing Redis stream, RabbitMQ queue or JetStream subject
//!   until Ctrl-C or SIGTERM, printing per message what happened (executed,
//!   replayed, recovered, nacked, dead-lettered) and a summary at the end.
//!
//! ```sh
//! cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! NATS_URL=nats://127.0.0.1:4222 cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example orders_consumer --features redis-streams,nats,rabbitmq
//! KAFKA_BROKERS=127.0.0.1:9092 cargo run --example orders_consumer --features redis-streams,nats,rabbitmq,kafka
//!
//! # consume what producers put in the stream `orders`, charges in orders-ledger.txt:
//! redis-cli XADD orders '*' id evt-1 payload '{"order":"o-1","amount":500,"sent_at":1}'
//! cargo run --example orders_consumer --features redis-streams,nats,rabbitmq -- consume orders orders-ledger.txt
//! ```
//!
//! Each charge is one line appended to the ledger file (`key order amount`):
//! the side effect survives the consumer, so a re-run shows whether anything
//! was charged twice. Every run uses run ids of its own (nanoseconds and
//! pid), so it never replays another run's keys.
//!
//! In consume mode the producer's message carries the order as JSON
//! (`{"order":"o-1","amount":500,"sent_at":…}`): in the entry's `payload`
//! field and an optional `id` field on Redis Streams, as the body (and
//! `message_id` property) on RabbitMQ, as the body (and `Nats-Msg-Id`
//! header) on JetStream. Dead letters go to `<stream>:dead` (Redis), the
//! queue's dead-letter exchange (RabbitMQ: declare the queue with
//! `declare_queue`) or `<subject>.dead` (JetStream: keep it captured by a
//! stream).
//!
//! idem keeps its records in the Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379/`; for Kafka: `tansu broker --storage-engine
//! memory://tansu/` is a Kafka-protocol broker from crates.io, `cargo
//! install tansu --features dynostore`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

use idem::consumer::nats::{NatsConfig, NatsConsumer, async_nats, pull_config};
use idem::consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue, lapin};
use idem::consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig, redis};
use idem::consumer::{
    Adapter, Classify, Consumer, ConsumerError, DeadLetterReason, Decision, ErrorClass, KeyDeriver,
    KeySource, Message, with_heartbeat,
};
use idem::{Idempotency, Outcome, RedisStore};
use serde::Deserialize;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

/// idem's lease: how long a crashed consumer's keys stay held before a
/// redelivery takes over (`recovered`). Renewed while a handler runs.
const LEASE: Duration = Duration::from_secs(3);
/// How long an unacked message waits before another consumer takes it:
/// Redis Streams' `claim_idle`, JetStream's `ack_wait`.
const REDELIVER_AFTER: Duration = Duration::from_secs(1);
/// The consumer group (Redis Streams) or durable consumer (JetStream).
const GROUP: &str = "billing";
/// How long the demo waits for its own events to be settled.
const DEMO_DEADLINE: Duration = Duration::from_secs(30);
/// The pretend payment provider's latency per charge (consume mode), in
/// milliseconds; default none.
const CHARGE_DELAY_ENV: &str = "ORDERS_CHARGE_DELAY_MS";

/// What to do, from the command line.
#[derive(Debug, Clone)]
pub(crate) enum Mode {
    /// Publish its own events, consume them, clean up.
    Demo,
    /// Consume `source` until stopped, charges appended to `ledger`.
    Consume { source: String, ledger: PathBuf },
}

impl Mode {
    /// `[]` → demo; `consume <source> [ledger]` → consume.
    pub(crate) fn from_args(mut args: impl Iterator<Item = String>) -> Result<Mode, String> {
        match args.next().as_deref() {
            None => Ok(Mode::Demo),
            Some("consume") => {
                let source = args.next().ok_or(
                    "consume needs the stream, queue or subject to read: `consume orders [ledger file]`",
                )?;
                let ledger = args.next().unwrap_or_else(|| "orders-ledger.txt".into());
                Ok(Mode::Consume {
                    source,
                    ledger: ledger.into(),
                })
            }
            Some(other) => Err(format!(
                "unknown argument `{other}`: run without arguments for the demo, or \
                 `consume <stream | queue | subject> [ledger file]`"
            )),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Order {
    order: String,
    amount: i64,
}

#[derive(Debug)]
enum ChargeError {
    /// The payment provider timed out: worth another delivery.
    Timeout,
    /// The order cannot be charged as it is.
    Invalid(String),
    /// The ledger file could not be read or written.
    Ledger(String),
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::Timeout => f.write_str("payment provider timed out"),
            ChargeError::Invalid(why) => write!(f, "invalid order: {why}"),
            ChargeError::Ledger(why) => write!(f, "ledger: {why}"),
        }
    }
}

/// A run id no other run shares: nanoseconds since the epoch and the pid.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:x}-{}", std::process::id())
}

/// The events the demo's producer sends: (message id, payload).
fn events(run: &str) -> Vec<(String, String)> {
    let order = |n: u32, amount: i64, sent_at: u32| {
        format!(r#"{{"order":"ord-{run}-{n}","amount":{amount},"sent_at":{sent_at}}}"#)
    };
    let mut e: Vec<(String, String)> = (1..=6)
        .map(|n| (format!("evt-{run}-{n}"), order(n, 100 * i64::from(n), 0)))
        .collect();
    e.push((format!("evt-{run}-2"), order(2, 200, 0))); // the same event delivered twice
    e.push((format!("evt-{run}-3-retry"), order(3, 300, 9))); // re-published under a new id
    e.push((format!("evt-{run}-7"), order(7, -5, 0))); // poison: never chargeable
    e.push((format!("evt-{run}-8"), order(8, 800, 0))); // flaky: the first attempt times out
    e
}

/// The ledger of charges: an append-only file, one `key order amount`
/// line per charge, written (and synced) before the charge counts as done.
#[derive(Debug, Clone)]
pub(crate) struct Ledger {
    path: PathBuf,
}

impl Ledger {
    /// The ledger in `path` (created at the first charge).
    pub(crate) fn at(path: impl Into<PathBuf>) -> Ledger {
        Ledger { path: path.into() }
    }

    /// Every charge so far: (key, order, amount).
    pub(crate) fn charges(&self) -> std::io::Result<Vec<(String, String, i64)>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        Ok(text
            .lines()
            .filter_map(|l| {
                let mut f = l.split(' ');
                let (key, order, amount) = (f.next()?, f.next()?, f.next()?.parse().ok()?);
                Some((key.to_owned(), order.to_owned(), amount))
            })
            .collect())
    }

    /// Appends one charge; on disk when it returns.
    fn append(&self, key: &str, order: &str, amount: i64) -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        // One write per line: concurrent appenders never interleave a line.
        f.write_all(format!("{key} {order} {amount}\n").as_bytes())?;
        f.sync_data()
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

struct Shop {
    ledger: Ledger,
    charge_delay: Duration,
}

impl Shop {
    /// The side effect: charge the customer, under idem's key for it.
    ///
    /// Like a payment provider's idempotency key, the key goes with the
    /// charge: a consumer killed after charging but before idem stored the
    /// result leaves the key to the next delivery once its lease ends (idem
    /// reports `recovered`), and the body cannot tell that run from a first
    /// one, so the ledger is asked first. idem keeps that question rare:
    /// duplicates replay without reaching the body.
    async fn charge(&self, key: String, m: Message) -> Result<String, ChargeError> {
        let o: Order = m.json().map_err(|e| ChargeError::Invalid(e.to_string()))?;
        if o.amount <= 0 {
            return Err(ChargeError::Invalid(format!(
                "amount {} is not positive",
                o.amount
            )));
        }
        // The flaky order: the provider times out on its first delivery.
        if o.order.ends_with("-8") && m.delivery_count() <= 1 {
            return Err(ChargeError::Timeout);
        }
        tokio::time::sleep(self.charge_delay).await;
        let receipt = format!("receipt-{}", o.order);
        let ledger = self.ledger.clone();
        tokio::task::spawn_blocking(move || {
            if ledger.charges()?.iter().any(|(k, _, _)| *k == key) {
                println!("  {} was charged before a crash: not again", o.order);
                return Ok(());
            }
            ledger.append(&key, &o.order, o.amount)
        })
        .await
        .map_err(|e| ChargeError::Ledger(e.to_string()))?
        .map_err(|e| ChargeError::Ledger(e.to_string()))?;
        Ok(receipt)
    }
}

/// What happened to the messages of one run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Charged now, for the first time.
    pub executed: usize,
    /// Duplicates of done work: the stored receipt, nothing charged.
    pub replayed: usize,
    /// Taken over from a consumer that died holding the key.
    pub recovered: usize,
    /// Copies of another message of the same batch: settled with it.
    pub copies: usize,
    /// Acked, nacked (redelivered later) and dead-lettered.
    pub acked: usize,
    pub nacked: usize,
    pub dead: usize,
}

impl Tally {
    /// Counts one message and says what happened to it, for the log.
    fn add(&mut self, outcome: Option<Outcome>, copy_of: Option<usize>, d: &Decision) -> String {
        let what = match (outcome, copy_of) {
            (_, Some(first)) => {
                self.copies += 1;
                format!("copy of #{first}")
            }
            (Some(Outcome::Executed), _) => {
                self.executed += 1;
                "executed".into()
            }
            (Some(Outcome::Replayed), _) => {
                self.replayed += 1;
                "replayed".into()
            }
            (Some(Outcome::Recovered), _) => {
                self.recovered += 1;
                "recovered".into()
            }
            (Some(other), _) => other.to_string(),
            (None, None) if d.is_ack() => "done".into(),
            (None, None) => "not charged".into(),
        };
        match d {
            Decision::Ack => self.acked += 1,
            Decision::Nack { .. } => self.nacked += 1,
            _ => self.dead += 1,
        }
        what
    }

    /// Messages done with: acked or dead-lettered.
    fn settled(&self) -> usize {
        self.acked + self.dead
    }
}

/// One fetched batch through idem, like [`Adapter::handle`] (heartbeat
/// included) but keeping what idem did with each message, not only the
/// decision: prints one line per message and counts it.
async fn handle_batch<A, C, H, Fut>(
    broker: &A,
    consumer: &Consumer<C>,
    handler: &H,
    fetched: Vec<A::Delivery>,
    tally: &mut Tally,
) -> Vec<(A::Delivery, Decision)>
where
    A: Adapter,
    C: Classify<ChargeError>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<String, ChargeError>> + Send,
{
    let read: Vec<Result<Message, ConsumerError>> =
        fetched.iter().map(|d| broker.message_of(d)).collect();
    let msgs: Vec<Message> = read
        .iter()
        .filter_map(|m| m.as_ref().ok().cloned())
        .collect();
    let batch = consumer.handle_batch(&msgs, handler);
    let handled = match broker.keep_alive_period() {
        Some(p) => {
            let period = p.min(consumer.keep_alive_period());
            with_heartbeat(batch, period, || broker.keep_alive(&fetched)).await
        }
        None => batch.await,
    };
    let mut handled = handled.into_iter();
    let mut decided = Vec::with_capacity(fetched.len());
    for (delivery, msg) in fetched.into_iter().zip(read) {
        let (outcome, copy_of, decision) = match &msg {
            Err(e) => {
                let reason = DeadLetterReason::BadMessage(e.to_string());
                (None, None, Decision::DeadLetter { reason })
            }
            Ok(_) => match handled.next() {
                Some(h) => (h.outcome, h.duplicate_of, h.decision),
                None => (
                    None,
                    None,
                    Decision::Nack {
                        delay: Duration::ZERO,
                    },
                ),
            },
        };
        let what = tally.add(outcome, copy_of, &decision);
        let id = msg.as_ref().ok().and_then(Message::id).unwrap_or("(no id)");
        let order = msg.as_ref().ok().and_then(|m| m.json::<Order>().ok());
        println!(
            "  {id:<28} {:<24} {what:<12} -> {decision}",
            order.map(|o| o.order).unwrap_or_default()
        );
        decided.push((delivery, decision));
    }
    decided
}

/// Fetches, handles and settles batches until `stop` completes or `done`
/// says so. A stop while a batch runs lets that batch finish and settle
/// (up to [`Consumer::drain_deadline`]; past it the batch is left unacked
/// and its keys held until their leases run out), so nothing is charged
/// twice by a restart. The same code for every broker.
async fn consume<A, C, H, Fut>(
    broker: &A,
    consumer: &Consumer<C>,
    handler: &H,
    stop: impl Future,
    done: impl Fn(&Tally) -> bool,
) -> Tally
where
    A: Adapter,
    C: Classify<ChargeError>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<String, ChargeError>> + Send,
{
    let mut stop = pin!(stop);
    let mut tally = Tally::default();
    let mut failures = 0;
    while !done(&tally) {
        let fetched = tokio::select! {
            biased;
            _ = &mut stop => break,
            f = broker.fetch() => f,
        };
        let fetched = match fetched {
            Ok(f) => f,
            Err(e) => {
                failures += 1;
                let pause = consumer.backoff_for(failures);
                eprintln!("fetch failed ({e}); again in {} ms", pause.as_millis());
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        failures = 0;
        if fetched.is_empty() {
            continue;
        }
        let (decided, stopping) = {
            let mut handling = pin!(handle_batch(broker, consumer, handler, fetched, &mut tally));
            tokio::select! {
                biased;
                d = &mut handling => (Some(d), false),
                _ = &mut stop => {
                    println!("stopping: letting the batch in flight finish");
                    let deadline = consumer.drain_deadline();
                    (tokio::time::timeout(deadline, handling).await.ok(), true)
                }
            }
        };
        match decided {
            Some(d) => settle(broker, d).await,
            None => eprintln!("handlers still running at the drain deadline: left unacked"),
        }
        if stopping {
            break;
        }
    }
    tally
}

/// Applies a batch's decisions; a failure only costs a redelivery, which
/// idem answers with the stored result.
async fn settle<A: Adapter>(broker: &A, decided: Vec<(A::Delivery, Decision)>) {
    if let Err(e) = broker.settle(decided).await {
        eprintln!("settling failed ({e}): the broker redelivers, idem replays");
    }
}

/// Resolves at Ctrl-C or SIGTERM. Both are caught from this call on (not
/// from the first poll): a stop that comes before the loop starts still
/// stops it cleanly.
fn stop_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut int, mut term) = (
        signal(SignalKind::interrupt())?,
        signal(SignalKind::terminate())?,
    );
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}

#[tokio::main]
async fn main() {
    let mode = match Mode::from_args(std::env::args().skip(1)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(mode).await {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// Runs the example in `mode`, on the broker the environment names.
pub(crate) async fn run(mode: Mode) -> Result<Tally, Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let store =
        match tokio::time::timeout(Duration::from_secs(3), RedisStore::connect(&redis_url)).await {
            Ok(Ok(s)) => s,
            _ => {
                return Err(format!(
                "nothing answers on {redis_url}: start one with `redis-server` (or set REDIS_URL)"
            )
            .into());
            }
        };
    let idem = Idempotency::builder(store)
        .namespace("orders-example")
        .lease(LEASE)
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        // One order, one charge: key on the order itself, not on the event id,
        // so a re-published event is a duplicate too.
        .keys(KeySource::Payload(KeyDeriver::new().exclude("/sent_at")?))
        .max_failures(3)
        .backoff(Duration::from_millis(200), Duration::from_secs(2))
        .classify(|e: &ChargeError| {
            ErrorClass::from_retryable(!matches!(e, ChargeError::Invalid(_)))
        });
    let run = run_id();
    let (ledger, charge_delay) = match &mode {
        Mode::Demo => (
            Ledger::at(std::env::temp_dir().join(format!("orders-ledger-{run}.txt"))),
            Duration::ZERO,
        ),
        Mode::Consume { ledger, .. } => (Ledger::at(ledger), charge_delay()?),
    };
    let shop = Arc::new(Shop {
        ledger: ledger.clone(),
        charge_delay,
    });
    let handler = |m: Message| {
        let (shop, key) = (shop.clone(), consumer.key_of(&m));
        async move {
            let key = key.map_err(|e| ChargeError::Invalid(e.to_string()))?;
            shop.charge(key, m).await
        }
    };
    let tally = match mode {
        Mode::Demo => demo(&redis_url, &run, &consumer, &handler).await?,
        Mode::Consume { source, .. } => {
            let stop = stop_signal()?;
            consume_existing(&redis_url, &run, &source, &consumer, &handler, stop).await?
        }
    };
    let charged = ledger.charges()?.len();
    println!(
        "summary: {} messages settled ({} acked, {} dead-lettered; {} nacks redelivered later): \
         {} executed, {} replayed, {} recovered, {} copies in a batch; the ledger {} holds {charged} charges",
        tally.settled(),
        tally.acked,
        tally.dead,
        tally.nacked,
        tally.executed,
        tally.replayed,
        tally.recovered,
        tally.copies,
        ledger.path().display(),
    );
    Ok(tally)
}

fn charge_delay() -> Result<Duration, String> {
    match std::env::var(CHARGE_DELAY_ENV) {
        Err(_) => Ok(Duration::ZERO),
        Ok(ms) => ms
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| format!("{CHARGE_DELAY_ENV}={ms} is not a number of milliseconds")),
    }
}

/// Consume mode: an existing stream, queue or subject, until stopped.
async fn consume_existing<C, H, Fut>(
    redis_url: &str,
    run: &str,
    source: &str,
    consumer: &Consumer<C>,
    handler: &H,
    stop: impl Future,
) -> Result<Tally, Box<dyn std::error::Error>>
where
    C: Classify<ChargeError>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<String, ChargeError>> + Send,
{
    let forever = |_: &Tally| false;
    let ready = || println!("consuming {source} until Ctrl-C or SIGTERM");
    if std::env::var("KAFKA_BROKERS").is_ok() {
        Err("consume mode runs on Redis Streams, NATS or RabbitMQ; unset KAFKA_BROKERS")?
    } else if let Ok(url) = std::env::var("NATS_URL") {
        println!("broker: NATS JetStream at {url}");
        let js = async_nats::jetstream::new(async_nats::connect(&url).await?);
        let name = js.stream_by_subject(source).await.map_err(|e| {
            format!("no JetStream stream captures the subject {source} ({e}): create one first")
        })?;
        let stream = js.get_stream(&name).await?;
        let durable = format!("{GROUP}-{}", source.replace(['.', '*', '>'], "_"));
        let mut config = pull_config(&durable, REDELIVER_AFTER);
        config.filter_subject = source.to_owned();
        let pull = stream.get_or_create_consumer(&durable, config).await?;
        let dead = format!("{source}.dead");
        let nats = NatsConsumer::new(pull, NatsConfig::new().dead_letter_subject(dead)).await?;
        ready();
        Ok(consume(&nats, consumer, handler, stop, forever).await)
    } else if let Ok(url) = std::env::var("AMQP_URL") {
        println!("broker: RabbitMQ at {url}");
        let conn = lapin::Connection::connect(&url, Default::default()).await?;
        let rabbit =
            RabbitConsumer::new(conn.create_channel().await?, RabbitConfig::new(source)).await?;
        ready();
        Ok(consume(&rabbit, consumer, handler, stop, forever).await)
    } else {
        println!("broker: Redis Streams at {redis_url}");
        let config =
            StreamsConfig::new(source, GROUP, format!("{GROUP}-{run}")).claim_idle(REDELIVER_AFTER);
        let stream = RedisStreamsConsumer::connect(redis_url, config).await?;
        stream.ensure_group().await?;
        ready();
        Ok(consume(&stream, consumer, handler, stop, forever).await)
    }
}

/// Demo mode: publishes [`events`] to a stream, queue or subject of its
/// own, consumes them until each is acked or dead-lettered (or
/// [`DEMO_DEADLINE`]), and deletes what it created.
async fn demo<C, H, Fut>(
    redis_url: &str,
    run: &str,
    consumer: &Consumer<C>,
    handler: &H,
) -> Result<Tally, Box<dyn std::error::Error>>
where
    C: Classify<ChargeError>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<String, ChargeError>> + Send,
{
    let events = events(run);
    let expected = events.len();
    let all_settled = |t: &Tally| t.settled() >= expected;
    let signalled = stop_signal()?;
    let stop = async {
        tokio::select! {
            () = signalled => {}
            () = tokio::time::sleep(DEMO_DEADLINE) => eprintln!("not all settled within {DEMO_DEADLINE:?}"),
        }
    };
    if let Ok(brokers) = std::env::var("KAFKA_BROKERS") {
        println!("broker: Kafka at {brokers}");
        return kafka::drain(&brokers, run, &events, consumer, handler).await;
    }
    if let Ok(url) = std::env::var("NATS_URL") {
        println!("broker: NATS JetStream at {url}");
        let js = async_nats::jetstream::new(async_nats::connect(&url).await?);
        let name = format!("ORDERS_EXAMPLE_{}", run.replace('-', "_"));
        let stream = js
            .create_stream(async_nats::jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                duplicate_window: Duration::from_millis(100),
                ..Default::default()
            })
            .await?;
        for (id, payload) in &events {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", id.as_str());
            js.publish_with_headers(format!("{name}.orders"), h, payload.clone().into())
                .await?
                .await?;
            tokio::time::sleep(Duration::from_millis(150)).await; // past JetStream's own de-duplication
        }
        let mut config = pull_config(GROUP, REDELIVER_AFTER);
        config.filter_subject = format!("{name}.orders"); // not the dead letters
        let pull = stream.create_consumer(config).await?;
        let nats = NatsConsumer::new(
            pull,
            NatsConfig::new().dead_letter_subject(format!("{name}.dead")),
        )
        .await?;
        let t = consume(&nats, consumer, handler, stop, all_settled).await;
        js.delete_stream(&name).await?;
        return Ok(t);
    }
    if let Ok(url) = std::env::var("AMQP_URL") {
        println!("broker: RabbitMQ at {url}");
        let conn = lapin::Connection::connect(&url, Default::default()).await?;
        let channel = conn.create_channel().await?;
        let queue = format!("orders-example-{run}");
        declare_queue(
            &channel,
            &queue,
            &format!("{queue}.dlx"),
            &format!("{queue}.dead"),
        )
        .await?;
        for (id, payload) in &events {
            let props = lapin::BasicProperties::default().with_message_id(id.as_str().into());
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    Default::default(),
                    payload.as_bytes(),
                    props,
                )
                .await?
                .await?;
        }
        let rabbit =
            RabbitConsumer::new(conn.create_channel().await?, RabbitConfig::new(&queue)).await?;
        let t = consume(&rabbit, consumer, handler, stop, all_settled).await;
        for q in [queue.clone(), format!("{queue}.dead")] {
            channel
                .queue_delete(q.as_str().into(), Default::default())
                .await?;
        }
        channel
            .exchange_delete(format!("{queue}.dlx").as_str().into(), Default::default())
            .await?;
        return Ok(t);
    }
    println!("broker: Redis Streams at {redis_url}");
    let name = format!("orders-example-{run}");
    let mut conn = redis::Client::open(redis_url)?
        .get_multiplexed_async_connection()
        .await?;
    for (id, payload) in &events {
        let _: String = redis::cmd("XADD")
            .arg(&name)
            .arg("*")
            .arg("id")
            .arg(id)
            .arg("payload")
            .arg(payload)
            .query_async(&mut conn)
            .await?;
    }
    let config = StreamsConfig::new(&name, GROUP, format!("{GROUP}-{run}"))
        .claim_idle(Duration::from_millis(300));
    let stream = RedisStreamsConsumer::connect(redis_url, config).await?;
    stream.ensure_group().await?;
    let t = consume(&stream, consumer, handler, stop, all_settled).await;
    let _: () = redis::cmd("DEL")
        .arg(&name)
        .arg(format!("{name}:dead"))
        .query_async(&mut conn)
        .await?;
    Ok(t)
}

#[cfg(not(feature = "kafka"))]
mod kafka {
    pub async fn drain<C, H>(
        _: &str,
        _: &str,
        _: &[(String, String)],
        _: &C,
        _: &H,
    ) -> Result<super::Tally, Box<dyn std::error::Error>> {
        Err("KAFKA_BROKERS needs the `kafka` feature: add it to --features".into())
    }
}

/// Kafka has no per-message ack: the adapter runs its own loop and commits
/// each partition up to the lowest record not yet decided.
#[cfg(feature = "kafka")]
mod kafka {
    use super::{ChargeError, Tally};
    use idem::consumer::kafka::rdkafka::admin::{
        AdminClient, AdminOptions, NewTopic, TopicReplication,
    };
    use idem::consumer::kafka::rdkafka::client::DefaultClientContext;
    use idem::consumer::kafka::rdkafka::config::ClientConfig;
    use idem::consumer::kafka::rdkafka::message::{Header, OwnedHeaders};
    use idem::consumer::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    use idem::consumer::kafka::{KafkaConfig, KafkaConsumer, header_names};
    use idem::consumer::{Classify, Consumer, Message};
    use std::future::Future;
    use std::time::{Duration, Instant};

    pub(crate) async fn drain<C, H, Fut>(
        brokers: &str,
        run: &str,
        events: &[(String, String)],
        consumer: &Consumer<C>,
        handler: &H,
    ) -> Result<Tally, Box<dyn std::error::Error>>
    where
        C: Classify<ChargeError>,
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<String, ChargeError>>,
    {
        let topic = format!("orders-example-{run}");
        let dead = format!("{topic}.DLT");
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        let topics = [
            NewTopic::new(&topic, 1, TopicReplication::Fixed(1)),
            NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
        ];
        for created in admin.create_topics(&topics, &AdminOptions::new()).await? {
            created.map_err(|(t, e)| format!("cannot create topic {t}: {e}"))?;
        }
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        for (id, payload) in events {
            let headers = OwnedHeaders::new().insert(Header {
                key: header_names::IDEMPOTENCY_KEY,
                value: Some(id.as_str()),
            });
            let record = FutureRecord::<str, str>::to(&topic)
                .payload(payload)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)?;
        }
        let kafka = KafkaConsumer::connect(KafkaConfig::new(brokers, "billing", [&topic]))?;
        // Done once the group's offset is past every event (or 30 s passed).
        let end = events.len() as i64;
        let deadline = Instant::now() + Duration::from_secs(30);
        let done = async {
            while kafka.last_committed(&topic, 0) != Some(end) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let report = kafka.run(consumer, handler, done).await?;
        kafka.close().await;
        println!("  {report:?}");
        Ok(Tally {
            executed: report
                .acked
                .saturating_sub(report.replayed + report.recovered),
            replayed: report.replayed,
            recovered: report.recovered,
            acked: report.acked,
            nacked: report.retried + report.nacked,
            dead: report.dead_lettered,
            ..Tally::default()
        })
    }
}
