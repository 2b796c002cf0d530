//! Place an order and publish its events through the outbox; downstream,
//! apply each event once.
//!
//! ```text
//! place ─(run_in_tx: order row + 2 outbox rows)─▶ PostgreSQL ─ relay ─▶ Kafka ─▶ ship (idem consumer)
//! ```
//!
//! Placing an order is one idem call, keyed by the order id, whose body
//! runs in a PostgreSQL transaction: it inserts the order row and publishes
//! two shipping events, `created` then `paid`, to the outbox. Row, events
//! and idem's stored result commit together or not at all, so a retried
//! request (the second `o-1` below) replays: no second row, no second
//! event. The relay publishes what committed to Kafka, in order per order
//! id, each message under a deterministic id; the shipping service consumes
//! with idem's Kafka adapter, so a message sent twice is applied once.
//!
//! ```sh
//! # Kafka: tansu, a Kafka-protocol broker (`cargo install tansu --locked --features dynostore`):
//! tansu broker --storage-engine memory://tansu/ \
//!     --listener-url tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092 &
//! # PostgreSQL at DATABASE_URL (default postgres://postgres@127.0.0.1/postgres):
//! cargo run --example orders_outbox --features postgres,kafka   # Kafka at KAFKA_BROKERS
//! ```
//!
//! `tests/it/orders_outbox_example.rs` runs [`place`] in a chain of
//! processes (RabbitMQ → place → relay → Kafka → ship) that it SIGKILLs
//! while PostgreSQL restarts: each order's row and each effect once.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "it prints")]
use idem::Idempotency;
use idem::consumer::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idem::consumer::kafka::rdkafka::{client::DefaultClientContext, config::ClientConfig};
use idem::consumer::kafka::{KafkaConfig, KafkaConsumer};
use idem::consumer::{Consumer, Message};
use idem::outbox::{self, KafkaSink, PgRelay};
use idem::postgres::sqlx::{self, PgConnection, PgPool};
use idem::postgres::{PgStore, RunInTx};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The orders table; the order id is not unique: a second insert would show.
pub(crate) const ORDERS_TABLE: &str = "orders_outbox_example";
/// The two events every order publishes, in this order.
pub(crate) const EVENTS: [&str; 2] = ["created", "paid"];

/// An order, as a client sends it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Order {
    /// The order id: idem's key, and the outbox's message key.
    pub(crate) order: String,
    pub(crate) amount: i64,
}

/// A shipping event (`created` or `paid`), as the outbox publishes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShipEvent {
    pub(crate) order: String,
    pub(crate) event: String,
    pub(crate) amount: i64,
}

/// Why placing an order committed nothing: idem (the key in flight
/// elsewhere, the store down, a publish refused…) or the order's INSERT.
#[derive(Debug)]
#[allow(dead_code)] // the fields are shown through Debug
pub(crate) enum PlaceError {
    Idem(idem::Error),
    Db(sqlx::Error),
}

impl From<idem::Error> for PlaceError {
    fn from(e: idem::Error) -> Self {
        PlaceError::Idem(e)
    }
}

impl From<sqlx::Error> for PlaceError {
    fn from(e: sqlx::Error) -> Self {
        PlaceError::Db(e)
    }
}

/// The body of placing an order, in the transaction idem commits its
/// stored result in: the row, then both events to `topic`, keyed by the
/// order id (the relay keeps one key's messages in order).
pub(crate) async fn place(tx: &mut PgConnection, topic: &str, o: &Order) -> Result<(), PlaceError> {
    let insert = format!("INSERT INTO {ORDERS_TABLE} (order_id, amount) VALUES ($1, $2)");
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(&o.order)
        .bind(o.amount)
        .execute(&mut *tx)
        .await?;
    for event in EVENTS {
        let e = ShipEvent {
            order: o.order.clone(),
            event: event.into(),
            amount: o.amount,
        };
        // Same transaction: the events exist if and only if the row does.
        outbox::publish(&mut *tx, topic, &o.order, &e).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let database = env("DATABASE_URL", "postgres://postgres@127.0.0.1/postgres");
    let brokers = env("KAFKA_BROKERS", "127.0.0.1:9092");
    let pool = PgPool::connect(&database).await?;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await?; // idem's tables, the outbox among them
    let table = format!(
        "CREATE TABLE IF NOT EXISTS {ORDERS_TABLE} \
         (seq bigserial PRIMARY KEY, order_id text NOT NULL, amount bigint NOT NULL)"
    );
    let _ = sqlx::query(sqlx::AssertSqlSafe(table))
        .execute(&pool)
        .await?;
    let idem = Idempotency::builder(store.clone()).build();

    // A topic of this run's own, with 3 partitions: one order's events
    // share a partition (same key), so they arrive in order.
    let run = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let run = format!("{:x}", run.as_nanos());
    let topic = format!("orders-outbox-{run}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let new = NewTopic::new(&topic, 3, TopicReplication::Fixed(1));
    for created in admin.create_topics([&new], &AdminOptions::new()).await? {
        created.map_err(|(t, e)| format!("cannot create topic {t}: {e}"))?;
    }

    // Two orders, and the first one again: a client retrying after a
    // timeout. The retry replays the stored result: nothing is inserted
    // or published twice.
    let order = |n: i64| Order {
        order: format!("o-{run}-{n}"),
        amount: 100 * n,
    };
    for o in [order(1), order(2), order(1)] {
        let placed = idem
            .call("orders.place", &o.order)
            .fingerprint(&o) // the same key with another order is refused
            .run_in_tx_outcome(&pool, async |tx| place(tx, &topic, &o).await)
            .await;
        match placed {
            Ok(((), outcome)) => println!("place {} -> {outcome}", o.order),
            Err(e) => println!("place {} -> failed, nothing committed: {e:?}", o.order),
        }
    }

    // The shipping service: applies each event once per message id, in
    // order per order id. Its effect here: a line printed, a count.
    let (shipped, progress) = tokio::sync::watch::channel(0);
    let consumer = Consumer::new(idem, "orders.ship");
    let kafka = KafkaConsumer::connect(
        KafkaConfig::new(&brokers, format!("shipping-{run}"), [&topic]).in_order_per_key(true),
    )?;
    let ship = |m: Message| {
        let shipped = &shipped;
        async move {
            let e: ShipEvent = m.json().map_err(|e| e.to_string())?;
            println!("ship  {} {}", e.order, e.event);
            shipped.send_modify(|n| *n += 1);
            Ok::<_, String>(())
        }
    };

    // The relay publishes what committed and deletes each message once
    // Kafka confirmed it. Both run until every event is shipped (or 60 s).
    let relay = PgRelay::new(&store, KafkaSink::from_brokers(&brokers)?);
    let all_shipped = || {
        let mut progress = progress.clone();
        async move {
            let all = progress.wait_for(|n| *n >= 2 * EVENTS.len());
            drop(tokio::time::timeout(Duration::from_secs(60), all).await);
        }
    };
    let (relayed, report) = tokio::join!(
        relay.run(all_shipped()),
        kafka.run(&consumer, &ship, all_shipped())
    );
    report?;
    kafka.close().await;
    let count = format!("SELECT count(*) FROM {ORDERS_TABLE} WHERE order_id LIKE $1");
    let (rows,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(count))
        .bind(format!("o-{run}-%"))
        .fetch_one(&pool)
        .await?;
    let shipped = *progress.borrow();
    println!(
        "summary: {rows} order rows, {} messages relayed, {shipped} events shipped",
        relayed.sent
    );
    Ok(())
}
