// An order row, idem's stored result and an `orders.created` message commit
// in one transaction; a relay then publishes the message to the Redis
// stream `orders.created`, under an id that an idem consumer there
// de-duplicates on. Cargo.toml: `idem = { version = "0.1", features =
// ["postgres", "redis-streams"] }`, `tokio = { version = "1", features =
// ["full"] }`, `serde_json = "1"`. Needs PostgreSQL at `DATABASE_URL` and
// Redis at `REDIS_URL`; watch with `redis-cli XRANGE orders.created - +`.
use idem::Idempotency;
use idem::outbox::{self, RedisStreamsSink, Relay};
use idem::postgres::sqlx::{self, PgPool};
use idem::postgres::{PgStore, RunInTx};

#[derive(Debug)]
#[allow(dead_code)] // the fields are shown through Debug
enum AppError {
    Db(sqlx::Error),
    Idem(idem::Error),
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

impl From<idem::Error> for AppError {
    fn from(e: idem::Error) -> Self {
        AppError::Idem(e)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/postgres".into());
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let pool = PgPool::connect(&url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, amount bigint)")
        .execute(&pool)
        .await?;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await?; // idem's tables, the outbox among them
    let idem = Idempotency::builder(store.clone())
        .namespace("shop")
        .build();

    // request-7 arrives twice: one row, one message.
    for request in ["request-7", "request-8", "request-7"] {
        let order: Result<String, AppError> = idem
            .call("orders.create", request)
            .run_in_tx(&pool, async |tx| {
                let order = format!("order-{request}");
                sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, 500)")
                    .bind(&order)
                    .execute(&mut *tx)
                    .await?;
                let event = serde_json::json!({ "order": order, "amount": 500 });
                outbox::publish(tx, "orders.created", &order, &event).await?; // same transaction
                Ok(order)
            })
            .await;
        println!("{request}: {order:?}");
    }

    // The relay publishes what committed, in order per order id, and
    // deletes each message once Redis has it. Run one per deployment (or
    // several: they share the work). Ctrl-C stops it after its pass.
    let relay = Relay::new(&store, RedisStreamsSink::connect(&redis).await?);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = relay.run(shutdown).await;
    println!("relayed {} message(s)", report.sent);
    Ok(())
}
