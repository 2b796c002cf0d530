//! Orders in PostgreSQL: the order row and the idempotent response commit in
//! one transaction.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --example orders_postgres --features postgres
//! ```
//!
//! It creates its tables (`idem_keys`, `orders_demo`) if missing, then plays
//! what a payment API sees in production:
//!
//! 1. a request creates an order: the row and the stored response commit together;
//! 2. the client retries (its first reply was lost): it gets the same order, no second row;
//! 3. eight duplicates race on a new key: one inserts, the others wait and replay;
//! 4. a request whose body fails after its INSERT: the row is rolled back and
//!    the key released, so the retry creates the order once;
//! 5. the same key with another payload: refused (fingerprint mismatch).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

use idem::postgres::sqlx::{self, PgConnection, PgPool};
use idem::postgres::{PgStore, RunInTx};
use idem::{Error, Idempotency, Outcome};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Order {
    id: i64,
    customer: String,
    amount: i64,
}

#[derive(Debug, Serialize)]
struct CreateOrder<'a> {
    customer: &'a str,
    amount: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields are shown through Debug
enum AppError {
    Db(sqlx::Error),
    Declined,
    Idem(Error),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(e)
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

/// The business write: plain SQL on the connection idem hands over.
async fn insert_order(tx: &mut PgConnection, req: &CreateOrder<'_>) -> Result<Order, AppError> {
    let (id,): (i64,) =
        sqlx::query_as("INSERT INTO orders_demo (customer, amount) VALUES ($1, $2) RETURNING id")
            .bind(req.customer)
            .bind(req.amount)
            .fetch_one(&mut *tx)
            .await?;
    Ok(Order {
        id,
        customer: req.customer.to_owned(),
        amount: req.amount,
    })
}

/// The endpoint: `key` is the client's Idempotency-Key.
async fn create_order(
    idem: &Idempotency,
    pool: &PgPool,
    key: &str,
    req: &CreateOrder<'_>,
) -> Result<(Order, Outcome), AppError> {
    idem.call("orders.create", key)
        .fingerprint(req)
        .wait(Duration::from_secs(5))
        .run_in_tx_outcome(pool, async |tx| insert_order(tx, req).await)
        .await
}

async fn rows(pool: &PgPool, customer: &str) -> i64 {
    sqlx::query_as::<_, (i64,)>("SELECT count(*) FROM orders_demo WHERE customer = $1")
        .bind(customer)
        .fetch_one(pool)
        .await
        .map(|r| r.0)
        .unwrap_or(-1)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("set DATABASE_URL, e.g. DATABASE_URL=postgres://postgres@127.0.0.1/postgres");
        std::process::exit(2);
    };
    let pool = PgPool::connect(&url).await?;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders_demo (id bigserial PRIMARY KEY, customer text NOT NULL, amount bigint NOT NULL)")
        .execute(&pool)
        .await?;
    let idem = Idempotency::builder(store).namespace("demo").build();
    // Fresh keys per run, so the demo can run again on the same database.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let customer = format!("alice-{run}");

    println!("1. a new request creates the order; row and stored response commit together");
    let req = CreateOrder {
        customer: &customer,
        amount: 500,
    };
    let key = format!("req-{run}-1");
    let (order, outcome) = create_order(&idem, &pool, &key, &req)
        .await
        .map_err(|e| format!("{e:?}"))?;
    println!(
        "   {outcome}: {order:?}, rows for {customer}: {}",
        rows(&pool, &customer).await
    );

    println!("2. the client retries with the same key (its reply was lost)");
    let (again, outcome) = create_order(&idem, &pool, &key, &req)
        .await
        .map_err(|e| format!("{e:?}"))?;
    println!(
        "   {outcome}: same order: {}, rows: {}",
        again == order,
        rows(&pool, &customer).await
    );

    println!("3. eight duplicates race on a new key");
    let key3 = format!("req-{run}-3");
    let racers = (0..8).map(|_| create_order(&idem, &pool, &key3, &req));
    let results = futures_util::future::join_all(racers).await;
    let outcomes: Vec<String> = results
        .iter()
        .map(|r| match r {
            Ok((_, o)) => o.to_string(),
            Err(e) => format!("{e:?}"),
        })
        .collect();
    println!(
        "   outcomes: {outcomes:?}, rows: {}",
        rows(&pool, &customer).await
    );

    println!("4. the body fails after its INSERT: rolled back, key released, the retry runs once");
    let key4 = format!("req-{run}-4");
    let failed = idem
        .call("orders.create", &key4)
        .fingerprint(&req)
        .run_in_tx(&pool, async |tx| {
            insert_order(tx, &req).await?;
            Err::<Order, _>(AppError::Declined) // e.g. the payment provider said no
        })
        .await;
    println!(
        "   first try: {:?}, rows: {}",
        failed.err(),
        rows(&pool, &customer).await
    );
    let (_, outcome) = create_order(&idem, &pool, &key4, &req)
        .await
        .map_err(|e| format!("{e:?}"))?;
    println!(
        "   retry: {outcome}, rows: {}",
        rows(&pool, &customer).await
    );

    println!("5. the same key with another payload is refused");
    let other = CreateOrder {
        customer: &customer,
        amount: 999,
    };
    match create_order(&idem, &pool, &key, &other).await {
        Err(AppError::Idem(e @ Error::FingerprintMismatch)) => println!("   refused: {e}"),
        r => println!("   unexpected: {r:?}"),
    }
    Ok(())
}
