//! The outbox end to end: orders taken from RabbitMQ, each one's row and
//! its two shipping events committed in one PostgreSQL transaction, the
//! events relayed to Kafka, and a second idem consumer applying each event
//! once to a ledger file, whatever is killed or restarted on the way.
//!
//! ```text
//! producer ─▶ RabbitMQ ─▶ take ─(run_in_tx: order row + 2 outbox rows)─▶ PostgreSQL
//!                                                                           │ relay
//!                                  ledger ◀─ ship ◀─ Kafka (SHIP_TOPIC) ◀───┘
//! ```
//!
//! Modes (first argument):
//!
//! - **take**: consumes the RabbitMQ queue `ORDERS_QUEUE`. Each message is
//!   an order, `{"order":"o-1","amount":500}` (AMQP `message_id` optional).
//!   Its idem call, keyed by the order id, runs `run_in_tx`: it inserts the
//!   order row and publishes two outbox messages with key = the order id,
//!   `created` then `paid`, both to the Kafka topic `SHIP_TOPIC` (the event
//!   is in the payload). Row, messages and idem's record commit together;
//!   a duplicate (same message, or the order published again) replays.
//! - **relay**: publishes the outbox to Kafka (`PgRelay` into a `KafkaSink`)
//!   until Ctrl-C or SIGTERM, in order per order id, each message under its
//!   deterministic id (header `idempotency-key`).
//! - **ship**: consumes `SHIP_TOPIC` in the consumer group `SHIP_GROUP`
//!   (idem's Kafka adapter, keys from the `idempotency-key` header, records
//!   of one order one after the other) and applies each event once: one
//!   line `order event` appended to the file `LEDGER`.
//! - **demo** (the default): everything in one process against local
//!   services, on a queue and topic of its own: publishes five orders, one
//!   of them twice under one id and one again under a new id, runs the three
//!   stages until every event is in the ledger, prints one line per message
//!   per stage and a summary, and deletes its queue.
//!
//! Every mode prints one line per message it handles and a summary when it
//! stops (Ctrl-C or SIGTERM; demo: when done).
//!
//! Environment:
//!
//! | variable | read by | default |
//! | --- | --- | --- |
//! | `DATABASE_URL` | all | `postgres://postgres@127.0.0.1:5432/postgres` |
//! | `AMQP_URL` | take, demo | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `ORDERS_QUEUE` | take | `orders` (demo: a queue of its own) |
//! | `KAFKA_BROKERS` | relay, ship, demo | `127.0.0.1:9092` |
//! | `SHIP_TOPIC` | take, relay, ship | `orders.shipping` (demo: a topic of its own) |
//! | `SHIP_GROUP` | ship | `shipping` |
//! | `LEDGER` | ship, demo | `orders-outbox-ledger.txt` (demo: in the temp directory) |
//! | `KAFKA_SESSION_TIMEOUT_MS` | ship, demo | `6000`: how long the group waits for a member that died before its partitions move |
//! | `ORDERS_WORK_DELAY_MS` | take, ship, demo | `0`: a pretend slow step inside each body (tests use it to widen the crash windows) |
//! | `RUST_LOG` | all | `warn` (idem's and the clients' logs, on stderr) |
//!
//! ```sh
//! # Kafka: tansu is a Kafka-protocol broker from crates.io
//! # (`cargo install tansu --locked --features dynostore`), in memory:
//! tansu broker --storage-engine memory://tansu/ \
//!     --listener-url tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092 &
//! # RabbitMQ on 127.0.0.1:5672, PostgreSQL on 127.0.0.1:5432 (user postgres), then:
//! cargo run --example orders_outbox --features postgres,rabbitmq,kafka
//!
//! # or each stage in a process of its own (kill and restart them at will):
//! cargo run --example orders_outbox --features postgres,rabbitmq,kafka -- take
//! cargo run --example orders_outbox --features postgres,rabbitmq,kafka -- relay
//! LEDGER=ledger.txt cargo run --example orders_outbox --features postgres,rabbitmq,kafka -- ship
//! ```
//!
//! Every stage outlives outages: PostgreSQL, RabbitMQ or Kafka down is
//! logged and retried; a stage killed at any point loses nothing, and its
//! restart neither inserts an order twice nor applies an event twice.
//! `tests/it/orders_outbox_example.rs` proves it by SIGKILLing the three
//! stages and restarting PostgreSQL while orders flow.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

use idem::Idempotency;
use idem::consumer::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idem::consumer::kafka::rdkafka::client::DefaultClientContext;
use idem::consumer::kafka::rdkafka::config::ClientConfig;
use idem::consumer::kafka::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use idem::consumer::kafka::{KafkaConfig, KafkaConsumer, KafkaReport};
use idem::consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue, lapin};
use idem::consumer::{
    Adapter, Consumer, ConsumerError, DeadLetterReason, Decision, ErrorClass, Message,
};
use idem::outbox::{self, KafkaSink, OutboxMessage, PgRelay, RelayReport, Sink, SinkError};
use idem::postgres::sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use idem::postgres::{PgStore, RunInTx, sqlx};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::watch;

/// idem's namespace for both consumers' keys.
const NAMESPACE: &str = "orders-outbox";
/// The take stage's operation: one order, one row.
const TAKE_SCOPE: &str = "orders.take";
/// The ship stage's operation: one event, one ledger line.
const SHIP_SCOPE: &str = "orders.ship";
/// The orders table (no unique constraint on the order id on purpose: a
/// second insert of one order would show as a second row).
const ORDERS_TABLE: &str = "orders_outbox_example";
/// The two events every order publishes, in this order.
pub(crate) const EVENTS: [&str; 2] = ["created", "paid"];
/// idem's lease: how long a key whose holder was killed stays held before
/// a redelivery takes over (`recovered`). Renewed while a body runs.
const LEASE: Duration = Duration::from_secs(3);
/// Partitions of the shipping topic: one order's records stay in one.
const PARTITIONS: i32 = 3;
/// Failed handler runs of one Kafka record before the adapter moves it
/// to the dead-letter topic. A run whose event was applied but whose
/// result PostgreSQL could not store (a restart at that moment) counts as
/// one, so keep room for outages: nothing here fails on its own.
const SHIP_ATTEMPTS: u32 = 20;
/// The demo's deadline for every event to reach the ledger.
const DEMO_DEADLINE: Duration = Duration::from_secs(60);

/// What to run, from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Consume orders from RabbitMQ into PostgreSQL and the outbox.
    Take,
    /// Publish the outbox to Kafka.
    Relay,
    /// Consume the events from Kafka into the ledger.
    Ship,
    /// All three in one process, on orders of its own.
    Demo,
}

impl Mode {
    /// `[]` or `demo`, `take`, `relay`, `ship`.
    pub(crate) fn from_args(mut args: impl Iterator<Item = String>) -> Result<Mode, ExampleError> {
        match args.next().as_deref() {
            None | Some("demo") => Ok(Mode::Demo),
            Some("take") => Ok(Mode::Take),
            Some("relay") => Ok(Mode::Relay),
            Some("ship") => Ok(Mode::Ship),
            Some(other) => Err(ExampleError::Usage(format!(
                "unknown mode `{other}`: run without arguments for the demo, or with `take`, \
                 `relay` or `ship`"
            ))),
        }
    }
}

/// Why a stage could not run.
#[derive(Debug)]
pub(crate) enum ExampleError {
    /// A bad command line or environment variable.
    Usage(String),
    /// PostgreSQL refused something the setup needs.
    Db(sqlx::Error),
    /// idem refused (its table cannot be created, say).
    Idem(idem::Error),
    /// A consumer adapter or sink could not be made.
    Broker(ConsumerError),
    /// RabbitMQ's client failed.
    Amqp(lapin::Error),
    /// Kafka's client failed.
    Kafka(KafkaError),
    /// The ledger file could not be read or written.
    Io(std::io::Error),
}

impl std::fmt::Display for ExampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExampleError::Usage(why) => f.write_str(why),
            ExampleError::Db(e) => write!(f, "PostgreSQL: {e}"),
            ExampleError::Idem(e) => write!(f, "idem: {e}"),
            ExampleError::Broker(e) => write!(f, "{e}"),
            ExampleError::Amqp(e) => write!(f, "RabbitMQ: {e}"),
            ExampleError::Kafka(e) => write!(f, "Kafka: {e}"),
            ExampleError::Io(e) => write!(f, "ledger: {e}"),
        }
    }
}

impl std::error::Error for ExampleError {}

impl From<sqlx::Error> for ExampleError {
    fn from(e: sqlx::Error) -> Self {
        ExampleError::Db(e)
    }
}

impl From<idem::Error> for ExampleError {
    fn from(e: idem::Error) -> Self {
        ExampleError::Idem(e)
    }
}

impl From<ConsumerError> for ExampleError {
    fn from(e: ConsumerError) -> Self {
        ExampleError::Broker(e)
    }
}

impl From<lapin::Error> for ExampleError {
    fn from(e: lapin::Error) -> Self {
        ExampleError::Amqp(e)
    }
}

impl From<KafkaError> for ExampleError {
    fn from(e: KafkaError) -> Self {
        ExampleError::Kafka(e)
    }
}

impl From<std::io::Error> for ExampleError {
    fn from(e: std::io::Error) -> Self {
        ExampleError::Io(e)
    }
}

/// The settings every mode reads from the environment.
#[derive(Debug, Clone)]
pub(crate) struct Env {
    /// `DATABASE_URL`.
    pub database_url: String,
    /// `AMQP_URL`.
    pub amqp_url: String,
    /// `ORDERS_QUEUE`.
    pub queue: String,
    /// `KAFKA_BROKERS`.
    pub brokers: String,
    /// `SHIP_TOPIC`.
    pub topic: String,
    /// `SHIP_GROUP`.
    pub group: String,
    /// `LEDGER`.
    pub ledger: PathBuf,
    /// `KAFKA_SESSION_TIMEOUT_MS`.
    pub session_timeout_ms: u32,
    /// `ORDERS_WORK_DELAY_MS`.
    pub work_delay: Duration,
}

impl Env {
    /// Reads the environment (see the table at the top).
    pub(crate) fn from_env() -> Result<Env, ExampleError> {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        let number = |name: &str, default: u32| -> Result<u32, ExampleError> {
            match std::env::var(name) {
                Err(_) => Ok(default),
                Ok(v) => v.parse().map_err(|_| {
                    ExampleError::Usage(format!("{name}={v} is not a number of milliseconds"))
                }),
            }
        };
        Ok(Env {
            database_url: var(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            amqp_url: var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            queue: var("ORDERS_QUEUE", "orders"),
            brokers: var("KAFKA_BROKERS", "127.0.0.1:9092"),
            topic: var("SHIP_TOPIC", "orders.shipping"),
            group: var("SHIP_GROUP", "shipping"),
            ledger: var("LEDGER", "orders-outbox-ledger.txt").into(),
            session_timeout_ms: number("KAFKA_SESSION_TIMEOUT_MS", 6000)?,
            work_delay: Duration::from_millis(u64::from(number("ORDERS_WORK_DELAY_MS", 0)?)),
        })
    }
}

/// An order, as the producer publishes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Order {
    /// The order id: idem's key in the take stage, the outbox key after.
    pub order: String,
    /// Its amount.
    pub amount: i64,
}

/// A shipping event, as the outbox publishes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShipEvent {
    /// The order.
    pub order: String,
    /// `created` or `paid`.
    pub event: String,
    /// The order's amount.
    pub amount: i64,
}

/// A shutdown request shared by the stages: Ctrl-C or SIGTERM in a stage
/// process, the demo itself when it is done.
#[derive(Debug, Clone)]
pub(crate) struct Stop(watch::Receiver<bool>);

impl Stop {
    /// A stop that `trigger` sets.
    pub(crate) fn new() -> (watch::Sender<bool>, Stop) {
        let (tx, rx) = watch::channel(false);
        (tx, Stop(rx))
    }

    /// A stop set by Ctrl-C or SIGTERM, both caught from this call on.
    pub(crate) fn on_signals() -> std::io::Result<Stop> {
        use tokio::signal::unix::{SignalKind, signal};
        let (mut int, mut term) = (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        );
        let (tx, stop) = Stop::new();
        tokio::spawn(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            let _ = tx.send(true);
        });
        Ok(stop)
    }

    /// Resolves once stopped.
    pub(crate) async fn wait(&mut self) {
        // A dropped sender stops too: nobody can start the stage again.
        let _ = self.0.wait_for(|stopped| *stopped).await;
    }
}

/// Runs `op` until it succeeds, backing off from 100 ms to 2 s and
/// logging each failure; `None` when stopped first. The stages start
/// while PostgreSQL or a broker may be down, and wait for them.
async fn until_ok<T, F, Fut>(what: &str, stop: &mut Stop, mut op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ExampleError>>,
{
    let mut pause = Duration::from_millis(100);
    loop {
        match op().await {
            Ok(v) => return Some(v),
            Err(e) => eprintln!("{what} failed ({e}); retrying in {} ms", pause.as_millis()),
        }
        tokio::select! {
            () = stop.wait() => return None,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// The database: a pool that connects on demand (so a restarted server is
/// reached again) and the idem store on it, with its tables and the
/// orders table created.
async fn database(env: &Env, stop: &mut Stop) -> Result<Option<(PgPool, PgStore)>, ExampleError> {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&env.database_url)?;
    let store = PgStore::from_pool(pool.clone());
    let ready = until_ok("PostgreSQL setup", stop, || async {
        store.migrate().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {ORDERS_TABLE} (\
             seq bigserial PRIMARY KEY, order_id text NOT NULL, amount bigint NOT NULL)"
        )))
        .execute(&pool)
        .await?;
        Ok(())
    })
    .await;
    Ok(ready.map(|()| (pool, store)))
}

/// The ledger of shipping effects: an append-only file, one `order event`
/// line per applied event.
#[derive(Debug, Clone)]
pub(crate) struct Ledger {
    path: PathBuf,
}

impl Ledger {
    /// The ledger in `path` (created at the first line).
    pub(crate) fn at(path: impl Into<PathBuf>) -> Ledger {
        Ledger { path: path.into() }
    }

    /// Every applied event so far, (order, event), in file order.
    pub(crate) fn entries(&self) -> std::io::Result<Vec<(String, String)>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        Ok(text
            .lines()
            .filter_map(|l| {
                let (order, event) = l.split_once(' ')?;
                Some((order.to_owned(), event.to_owned()))
            })
            .collect())
    }

    /// Appends one event; on disk when it returns.
    fn append(&self, order: &str, event: &str) -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        // One write per line: concurrent appenders never interleave a line.
        f.write_all(format!("{order} {event}\n").as_bytes())?;
        f.sync_data()
    }
}

// ------------------------------------------------------------------ take

/// Why a take body did not commit.
#[derive(Debug)]
enum TakeError {
    /// idem: the key is in flight elsewhere, the store is down, a publish
    /// was refused…
    Idem(idem::Error),
    /// The order's INSERT (PostgreSQL down mid-body, say).
    Db(sqlx::Error),
}

impl From<idem::Error> for TakeError {
    fn from(e: idem::Error) -> Self {
        TakeError::Idem(e)
    }
}

impl From<sqlx::Error> for TakeError {
    fn from(e: sqlx::Error) -> Self {
        TakeError::Db(e)
    }
}

/// What the take stage did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TakeTally {
    /// Orders inserted (with their events) now.
    pub executed: usize,
    /// Duplicates: the stored result, nothing inserted.
    pub replayed: usize,
    /// Taken over from a consumer killed holding the order.
    pub recovered: usize,
    /// Handed back to come again later (store down, order in flight).
    pub nacked: usize,
    /// Dead-lettered (not an order).
    pub dead: usize,
}

/// One stage's view of the database and idem.
struct Take<'a> {
    env: &'a Env,
    pool: PgPool,
    idem: Idempotency,
}

impl Take<'_> {
    /// Runs one order message through idem: the row and both events in one
    /// transaction, at most once per order id.
    async fn one(&self, m: &Message) -> (Option<Order>, String, Decision) {
        let order: Order = match m.json() {
            Ok(o) => o,
            Err(e) => {
                let reason = DeadLetterReason::BadMessage(e.to_string());
                return (None, "unreadable".into(), Decision::DeadLetter { reason });
            }
        };
        // The ledger and the logs take the id as one word.
        if order.order.is_empty() || order.order.contains(char::is_whitespace) {
            let reason = DeadLetterReason::Permanent(format!("bad order id {:?}", order.order));
            return (
                Some(order),
                "invalid".into(),
                Decision::DeadLetter { reason },
            );
        }
        let (env, o) = (self.env, &order);
        let taken = self
            .idem
            .call(TAKE_SCOPE, &order.order)
            .fingerprint(&order)
            .run_in_tx_outcome(&self.pool, async |tx: &mut PgConnection| {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {ORDERS_TABLE} (order_id, amount) VALUES ($1, $2)"
                )))
                .bind(&o.order)
                .bind(o.amount)
                .execute(&mut *tx)
                .await?;
                // A slow step inside the transaction: a kill lands here too.
                tokio::time::sleep(env.work_delay).await;
                for event in EVENTS {
                    let e = ShipEvent {
                        order: o.order.clone(),
                        event: event.into(),
                        amount: o.amount,
                    };
                    // Same transaction: the events exist iff the row does.
                    outbox::publish(&mut *tx, &env.topic, &o.order, &e).await?;
                }
                Ok::<_, TakeError>(())
            })
            .await;
        let backoff = backoff(m.delivery_count());
        let (what, decision) = match taken {
            Ok(((), outcome)) => (outcome.to_string(), Decision::Ack),
            Err(TakeError::Idem(idem::Error::InProgress { retry_after })) => (
                "in flight".into(),
                Decision::Nack {
                    delay: retry_after.max(Duration::from_millis(50)),
                },
            ),
            Err(TakeError::Idem(idem::Error::FingerprintMismatch)) => (
                "reused id".into(),
                Decision::DeadLetter {
                    reason: DeadLetterReason::FingerprintMismatch,
                },
            ),
            Err(TakeError::Idem(idem::Error::InvalidKey(k))) => (
                "bad key".into(),
                Decision::DeadLetter {
                    reason: DeadLetterReason::BadMessage(k.to_string()),
                },
            ),
            // Nothing committed (the store or the database is down, the
            // lease was lost): the order comes back.
            Err(TakeError::Idem(e)) => {
                eprintln!("take {}: {e}; redelivering", order.order);
                ("failed".into(), Decision::Nack { delay: backoff })
            }
            Err(TakeError::Db(e)) => {
                eprintln!("take {}: PostgreSQL: {e}; redelivering", order.order);
                ("failed".into(), Decision::Nack { delay: backoff })
            }
        };
        (Some(order), what, decision)
    }
}

/// The nack delay after the `delivery`-th delivery: 200 ms doubling to 2 s.
fn backoff(delivery: u32) -> Duration {
    let doublings = delivery.saturating_sub(1).min(4);
    (Duration::from_millis(200) * (1u32 << doublings)).min(Duration::from_secs(2))
}

/// The take stage: consumes `env.queue` until `stop`.
pub(crate) async fn take(env: &Env, mut stop: Stop) -> Result<TakeTally, ExampleError> {
    let mut tally = TakeTally::default();
    let Some((pool, store)) = database(env, &mut stop).await? else {
        return Ok(tally);
    };
    let idem = Idempotency::builder(store)
        .namespace(NAMESPACE)
        .lease(LEASE)
        .build();
    let stage = Take { env, pool, idem };
    // A lost connection or channel ends the adapter: connect again.
    loop {
        let connected = until_ok("RabbitMQ connection", &mut stop, || async {
            let conn = lapin::Connection::connect(&env.amqp_url, Default::default()).await?;
            let rabbit =
                RabbitConsumer::new(conn.create_channel().await?, RabbitConfig::new(&env.queue))
                    .await?;
            Ok((conn, rabbit))
        })
        .await;
        let Some((_conn, rabbit)) = connected else {
            return Ok(tally);
        };
        println!("take: consuming {} until Ctrl-C or SIGTERM", env.queue);
        loop {
            let fetched = tokio::select! {
                biased;
                () = stop.wait() => return Ok(tally),
                f = rabbit.fetch() => f,
            };
            let fetched = match fetched {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("take: {e}; connecting again");
                    break;
                }
            };
            // A batch is finished and settled even when a stop comes
            // meanwhile: nothing is half done at a clean stop.
            let mut decided = Vec::with_capacity(fetched.len());
            for delivery in fetched {
                let (order, what, decision) = match rabbit.message_of(&delivery) {
                    Ok(m) => {
                        let (order, what, decision) = stage.one(&m).await;
                        let id = m.id().unwrap_or("(no id)").to_owned();
                        (
                            order.map(|o| format!("{id:<20} {}", o.order)),
                            what,
                            decision,
                        )
                    }
                    Err(e) => {
                        let reason = DeadLetterReason::BadMessage(e.to_string());
                        (None, "unreadable".into(), Decision::DeadLetter { reason })
                    }
                };
                match (&decision, what.as_str()) {
                    (Decision::Ack, "replayed") => tally.replayed += 1,
                    (Decision::Ack, "recovered") => tally.recovered += 1,
                    (Decision::Ack, _) => tally.executed += 1,
                    (Decision::Nack { .. }, _) => tally.nacked += 1,
                    _ => tally.dead += 1,
                }
                println!(
                    "take  {:<36} {what:<10} -> {decision}",
                    order.unwrap_or_default()
                );
                decided.push((delivery, decision));
            }
            if let Err(e) = rabbit.settle(decided).await {
                eprintln!("take: settling failed ({e}); RabbitMQ redelivers, idem replays");
                break;
            }
        }
    }
}

// ----------------------------------------------------------------- relay

/// A sink that prints what the broker confirmed or refused, one line per
/// message, around the real one.
struct Printed<S>(S);

#[async_trait::async_trait]
impl<S: Sink> Sink for Printed<S> {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let results = self.0.send(batch).await;
        for (m, r) in batch.iter().zip(&results) {
            let event = serde_json::from_slice::<ShipEvent>(&m.payload)
                .map(|e| e.event)
                .unwrap_or_default();
            let what = match r {
                Ok(()) => "confirmed".to_owned(),
                Err(e) => e.to_string(),
            };
            println!(
                "relay {:<20} {} {event:<8} (attempt {}) -> {what}",
                &m.id[..m.id.len().min(20)],
                m.key,
                m.attempts + 1
            );
        }
        results
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// Creates the shipping topic and its dead-letter topic when missing.
pub(crate) async fn ensure_topics(env: &Env) -> Result<(), ExampleError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &env.brokers)
        .create()?;
    let dead = format!("{}.DLT", env.topic);
    let topics = [
        NewTopic::new(&env.topic, PARTITIONS, TopicReplication::Fixed(1)),
        NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
    ];
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    for created in admin.create_topics(&topics, &options).await? {
        match created {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => {
                return Err(ExampleError::Usage(format!("cannot create topic {t}: {e}")));
            }
        }
    }
    Ok(())
}

/// The relay stage: publishes the outbox to Kafka until `stop`.
pub(crate) async fn relay(env: &Env, mut stop: Stop) -> Result<RelayReport, ExampleError> {
    let Some((_pool, store)) = database(env, &mut stop).await? else {
        return Ok(RelayReport::default());
    };
    // A topic that does not exist would be refused, and the relay would
    // park its messages.
    if until_ok("creating the Kafka topics", &mut stop, || {
        ensure_topics(env)
    })
    .await
    .is_none()
    {
        return Ok(RelayReport::default());
    }
    let sink = Printed(KafkaSink::from_brokers(&env.brokers)?);
    let relay = PgRelay::new(&store, sink)
        // Quick to pick up a peer's leftovers and to retry after an
        // outage: this is a demo, not a fleet.
        .poll_interval(Duration::from_secs(1))
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(2));
    println!(
        "relay: publishing to {} until Ctrl-C or SIGTERM",
        env.brokers
    );
    Ok(relay.run(stop.wait()).await)
}

// ------------------------------------------------------------------ ship

/// Why a ship handler failed.
#[derive(Debug)]
enum ShipError {
    /// Not a shipping event: dead-lettered.
    Invalid(String),
    /// The ledger could not be read or written: tried again.
    Ledger(String),
}

impl std::fmt::Display for ShipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShipError::Invalid(why) => write!(f, "not a shipping event: {why}"),
            ShipError::Ledger(why) => write!(f, "ledger: {why}"),
        }
    }
}

/// What the ship stage did.
#[derive(Debug, Default, Clone)]
pub(crate) struct ShipTally {
    /// Events appended to the ledger now.
    pub applied: usize,
    /// Events found in the ledger already: a consumer was killed after
    /// applying them and before idem stored that (the run was `recovered`).
    pub found: usize,
    /// The Kafka adapter's counts (acked, replayed, recovered…).
    pub report: KafkaReport,
}

/// Applies one event: its ledger line, unless it is there already.
///
/// idem runs this once per message id; only a consumer killed between the
/// append and idem's record leaves the key to the next one after the lease
/// (`recovered`), and that run cannot tell itself from a first one, so the
/// ledger is asked first (as a payment provider's idempotency key would
/// be).
async fn apply(ledger: &Ledger, delay: Duration, m: Message) -> Result<bool, ShipError> {
    let e: ShipEvent = m.json().map_err(|e| ShipError::Invalid(e.to_string()))?;
    if e.order.is_empty()
        || e.order.contains(char::is_whitespace)
        || !EVENTS.contains(&e.event.as_str())
    {
        return Err(ShipError::Invalid(format!("{e:?}")));
    }
    let ledger = ledger.clone();
    let (order, event) = (e.order.clone(), e.event.clone());
    let applied = tokio::task::spawn_blocking(move || {
        let done = ledger
            .entries()?
            .iter()
            .any(|(o, ev)| *o == order && *ev == event);
        if !done {
            ledger.append(&order, &event)?;
        }
        Ok::<_, std::io::Error>(!done)
    })
    .await
    .map_err(|e| ShipError::Ledger(e.to_string()))?
    .map_err(|e| ShipError::Ledger(e.to_string()))?;
    // A slow step after the effect (telling the carrier): a kill here
    // leaves the effect done and idem's record not written.
    tokio::time::sleep(delay).await;
    println!(
        "ship  {:<20} {} {:<8} -> {}",
        &m.id().unwrap_or("(no id)")[..m.id().map_or(7, |i| i.len().min(20))],
        e.order,
        e.event,
        if applied {
            "applied"
        } else {
            "in the ledger already"
        }
    );
    Ok(applied)
}

/// The ship stage: consumes the shipping topic into the ledger until `stop`.
pub(crate) async fn ship(env: &Env, mut stop: Stop) -> Result<ShipTally, ExampleError> {
    let Some((_pool, store)) = database(env, &mut stop).await? else {
        return Ok(ShipTally::default());
    };
    if until_ok("creating the Kafka topics", &mut stop, || {
        ensure_topics(env)
    })
    .await
    .is_none()
    {
        return Ok(ShipTally::default());
    }
    let idem = Idempotency::builder(store)
        .namespace(NAMESPACE)
        .lease(LEASE)
        .build();
    let consumer = Consumer::new(idem, SHIP_SCOPE)
        .backoff(Duration::from_millis(100), Duration::from_secs(2))
        .classify(|e: &ShipError| ErrorClass::from_retryable(matches!(e, ShipError::Ledger(_))));
    let kafka = KafkaConsumer::connect(
        KafkaConfig::new(&env.brokers, &env.group, [&env.topic])
            // created before paid: one order's records one after the other.
            .in_order_per_key(true)
            .attempts_in_process(SHIP_ATTEMPTS)
            .commit_interval(Duration::from_millis(200))
            .set("session.timeout.ms", env.session_timeout_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (env.session_timeout_ms / 10).max(100).to_string(),
            ),
    )?;
    let ledger = Ledger::at(&env.ledger);
    let applied = std::sync::atomic::AtomicUsize::new(0);
    let found = std::sync::atomic::AtomicUsize::new(0);
    let handler = |m: Message| {
        let (ledger, applied, found) = (&ledger, &applied, &found);
        async move {
            let now = apply(ledger, env.work_delay, m).await?;
            let counter = if now { applied } else { found };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, ShipError>(now)
        }
    };
    println!(
        "ship: consuming {} (group {}) into {} until Ctrl-C or SIGTERM",
        env.topic,
        env.group,
        env.ledger.display()
    );
    let report = kafka.run(&consumer, &handler, stop.wait()).await?;
    // Out of the group before the process exits: the next `ship` gets the
    // partitions at once, not after the session timeout.
    kafka.close().await;
    Ok(ShipTally {
        applied: applied.into_inner(),
        found: found.into_inner(),
        report,
    })
}

// ------------------------------------------------------------------ demo

/// What the demo saw.
#[derive(Debug, Default, Clone)]
pub(crate) struct Summary {
    /// The take stage.
    pub take: TakeTally,
    /// The relay.
    pub relay: RelayReport,
    /// The ship stage.
    pub ship: ShipTally,
    /// Order rows of this run in PostgreSQL.
    pub rows: i64,
    /// Ledger lines of this run.
    pub effects: usize,
}

/// A run id no other run shares: nanoseconds since the epoch and the pid.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:x}-{}", std::process::id())
}

/// The demo: its own queue, topic and ledger, five orders with a
/// duplicate and a re-publish, the three stages until every event is in
/// the ledger (or [`DEMO_DEADLINE`]).
async fn demo(base: &Env) -> Result<Summary, ExampleError> {
    let run = run_id();
    let mut env = base.clone();
    env.queue = format!("orders-outbox-demo-{run}");
    env.topic = format!("orders-outbox-demo-{run}");
    env.group = format!("shipping-{run}");
    if std::env::var("LEDGER").is_err() {
        env.ledger = std::env::temp_dir().join(format!("orders-outbox-ledger-{run}.txt"));
    }
    let orders: Vec<Order> = (1..=5)
        .map(|n| Order {
            order: format!("ord-{run}-{n}"),
            amount: 100 * n,
        })
        .collect();
    // (message id, order): order 2 twice under one id, order 3 again under
    // a new id.
    let mut messages: Vec<(String, &Order)> = orders
        .iter()
        .enumerate()
        .map(|(i, o)| (format!("evt-{}", i + 1), o))
        .collect();
    messages.push(("evt-2".into(), &orders[1]));
    messages.push(("evt-3-again".into(), &orders[2]));

    println!(
        "demo: queue {}, topic {} on {}, ledger {}",
        env.queue,
        env.topic,
        env.brokers,
        env.ledger.display()
    );
    let conn = lapin::Connection::connect(&env.amqp_url, Default::default()).await?;
    let channel = conn.create_channel().await?;
    let (dlx, dead) = (format!("{}.dlx", env.queue), format!("{}.dead", env.queue));
    declare_queue(&channel, &env.queue, &dlx, &dead).await?;
    for (id, order) in &messages {
        let body = serde_json::to_vec(order)
            .map_err(|e| ExampleError::Usage(format!("cannot encode an order: {e}")))?;
        let props = lapin::BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        channel
            .basic_publish(
                "".into(),
                env.queue.as_str().into(),
                Default::default(),
                &body,
                props,
            )
            .await?
            .await?;
        println!("publish {id:<20} {}", order.order);
    }

    let (trigger, stop) = Stop::new();
    let ledger = Ledger::at(&env.ledger);
    let expected = orders.len() * EVENTS.len();
    let watch = async {
        let end = tokio::time::Instant::now() + DEMO_DEADLINE;
        loop {
            let n = ledger.entries().map(|e| e.len()).unwrap_or(0);
            if n >= expected {
                break;
            }
            if tokio::time::Instant::now() >= end {
                eprintln!(
                    "demo: only {n} of {expected} events in the ledger after {DEMO_DEADLINE:?}"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = trigger.send(true);
    };
    let (take, relay, ship, ()) = tokio::join!(
        take(&env, stop.clone()),
        relay(&env, stop.clone()),
        ship(&env, stop.clone()),
        watch
    );
    let (pool, _) = match database(&env, &mut Stop::new().1).await? {
        Some(db) => db,
        None => return Err(ExampleError::Usage("PostgreSQL went away".into())),
    };
    let (rows,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {ORDERS_TABLE} WHERE order_id LIKE $1"
    )))
    .bind(format!("ord-{run}-%"))
    .fetch_one(&pool)
    .await?;
    for q in [&env.queue, &dead] {
        channel
            .queue_delete(q.as_str().into(), Default::default())
            .await?;
    }
    channel
        .exchange_delete(dlx.as_str().into(), Default::default())
        .await?;
    Ok(Summary {
        take: take?,
        relay: relay?,
        ship: ship?,
        rows,
        effects: ledger.entries()?.len(),
    })
}

// ------------------------------------------------------------------ main

#[tokio::main]
async fn main() {
    let code = match Mode::from_args(std::env::args().skip(1)) {
        Err(e) => {
            eprintln!("{e}");
            2
        }
        Ok(mode) => match run(mode).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{e}");
                1
            }
        },
    };
    std::process::exit(code);
}

/// Runs `mode` with the settings of the environment, printing a summary
/// when it stops.
pub(crate) async fn run(mode: Mode) -> Result<(), ExampleError> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let env = Env::from_env()?;
    let stop = || {
        let stop = Stop::on_signals().map_err(ExampleError::Io)?;
        // Once per process, once a stop is caught: a supervisor (the test)
        // may send SIGTERM from here on.
        println!(
            "{mode:?} started (pid {}): Ctrl-C or SIGTERM stops it cleanly",
            std::process::id()
        );
        Ok::<_, ExampleError>(stop)
    };
    match mode {
        Mode::Take => {
            let t = take(&env, stop()?).await?;
            println!(
                "take summary: {} orders inserted, {} replayed, {} recovered, {} nacked, {} dead-lettered",
                t.executed, t.replayed, t.recovered, t.nacked, t.dead
            );
        }
        Mode::Relay => {
            let r = relay(&env, stop()?).await?;
            println!(
                "relay summary: {} messages relayed, {} parked, {} failed sends retried",
                r.sent, r.parked, r.failed
            );
        }
        Mode::Ship => {
            let s = ship(&env, stop()?).await?;
            println!(
                "ship summary: {} effects applied, {} found applied already, {} replayed, {} recovered, {} dead-lettered",
                s.applied, s.found, s.report.replayed, s.report.recovered, s.report.dead_lettered
            );
        }
        Mode::Demo => {
            let s = demo(&env).await?;
            println!(
                "summary: {} orders inserted ({} rows), {} messages relayed, {} effects applied \
                 ({} ledger lines), replays: {} at take, {} at ship; recovered: {} at take, {} at ship",
                s.take.executed + s.take.recovered,
                s.rows,
                s.relay.sent,
                s.ship.applied,
                s.effects,
                s.take.replayed,
                s.ship.report.replayed,
                s.take.recovered,
                s.ship.report.recovered,
            );
        }
    }
    Ok(())
}
