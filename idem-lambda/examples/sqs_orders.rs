//! An AWS Lambda function on an SQS queue: each order message charges the
//! customer once, however often SQS delivers it (a redelivery replays the
//! first charge), and the function answers with the records to redeliver
//! (the event source mapping needs `ReportBatchItemFailures`).
//! Cargo.toml: `idem = { version = "0.1", features = ["lambda"] }`,
//! `serde = { version = "1", features = ["derive"] }`, `serde_json = "1"`,
//! `tokio = { version = "1", features = ["macros", "rt-multi-thread"] }`.
//! Build and deploy: `cargo lambda build --release --arm64`, `cargo lambda deploy`.
use idem::consumer::{Consumer, ErrorClass};
use idem::lambda::aws_lambda_events::sqs::{SqsEvent, SqsMessage};
use idem::lambda::lambda_runtime::{self, LambdaEvent, service_fn};
use idem::lambda::{SqsBatchHandler, SqsKey};
use idem::{Idempotency, RedisStore};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Deserialize)]
struct Order {
    id: String,
    amount_cents: u64,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    order: String,
    charge: String,
}

#[derive(Debug)]
enum ChargeError {
    /// The message is not an order: it will never succeed.
    BadOrder(String),
    /// The payment provider timed out: worth another delivery.
    Timeout,
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::BadOrder(e) => write!(f, "not an order: {e}"),
            ChargeError::Timeout => f.write_str("payment provider timed out"),
        }
    }
}

/// The side effect: runs once per order.
async fn charge(msg: SqsMessage) -> Result<Receipt, ChargeError> {
    let order: Order = serde_json::from_str(msg.body.as_deref().unwrap_or(""))
        .map_err(|e| ChargeError::BadOrder(e.to_string()))?;
    if order.amount_cents == 0 {
        return Err(ChargeError::BadOrder("amount is zero".into()));
    }
    let charge = provider_charge(&order).await?;
    Ok(Receipt {
        order: order.id,
        charge,
    })
}

/// The payment provider (a stand-in): it charges once per idempotency key
/// of its own too, where it has them.
async fn provider_charge(order: &Order) -> Result<String, ChargeError> {
    if std::env::var_os("PROVIDER_DOWN").is_some() {
        return Err(ChargeError::Timeout);
    }
    Ok(format!("ch_{}_{}", order.id, order.amount_cents))
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    lambda_runtime::tracing::init_default_subscriber();
    // Shared by every copy of the function: Redis (ElastiCache, or any
    // Redis/Valkey the function reaches) here; DynamoDB works the same.
    let store = RedisStore::connect(&std::env::var("REDIS_URL")?).await?;
    let idem = Idempotency::builder(store)
        .namespace("orders")
        .result_ttl(Duration::from_secs(4 * 24 * 3600)) // the queue's retention period
        .lease(Duration::from_secs(30)) // bounded further by each invocation's deadline
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        .max_failures(3)
        .classify(|e: &ChargeError| ErrorClass::from_retryable(matches!(e, ChargeError::Timeout)));
    let batch = SqsBatchHandler::from_consumer(consumer)
        // Key on the order, not the message: two sends of one order charge once.
        .keys(SqsKey::custom(|m: &SqsMessage| {
            let order: Order = serde_json::from_str(m.body.as_deref().unwrap_or(""))
                .map_err(|e| idem::consumer::ConsumerError::Malformed(e.to_string()))?;
            Ok(order.id)
        }));
    // Dead letters (a bad order, 3 timeouts) are listed as failures: the
    // queue's redrive policy moves them to its dead-letter queue.
    lambda_runtime::run(service_fn(|event: LambdaEvent<SqsEvent>| {
        let batch = batch.clone();
        async move { batch.handle(event, &charge).await }
    }))
    .await
}
