// Inserts an order row and stores idem's result in one transaction: a
// redelivered request replays the row's id and inserts nothing. Cargo.toml:
// `idem = { version = "0.1", features = ["postgres"] }`, `tokio = { version
// = "1", features = ["full"] }`. Needs PostgreSQL at `DATABASE_URL`.
use idem::Idempotency;
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
    let pool = PgPool::connect(&url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text)")
        .execute(&pool)
        .await?;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await?; // idem's table, beside yours
    let idem = Idempotency::builder(store).namespace("shop").build();

    for delivery in 1..=2 {
        let order: Result<(i64, idem::Outcome), AppError> = idem
            .call("orders.create", "request-7")
            .run_in_tx_outcome(&pool, async |tx| {
                let (id,): (i64,) =
                    sqlx::query_as("INSERT INTO orders (customer) VALUES ($1) RETURNING id")
                        .bind("ada")
                        .fetch_one(&mut *tx)
                        .await?;
                Ok(id) // commits with the row, or neither does
            })
            .await;
        println!("delivery {delivery}: {order:?}"); // Executed, then the same id Replayed
    }
    Ok(())
}
