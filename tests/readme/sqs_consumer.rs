// Charges each order on an SQS queue once, whatever SQS redelivers.
// Cargo.toml: `idem = { version = "0.1", features = ["sqs"] }`, `aws-config
// = "1"`, `tokio = { version = "1", features = ["full"] }`. Needs Redis on
// 6379 (or `REDIS_URL`), AWS credentials and a region where the AWS SDK
// looks for them (`AWS_ENDPOINT_URL` for a local endpoint), and the queue's
// URL in `QUEUE_URL`, a queue with a redrive policy; send an order with
// `aws sqs send-message --queue-url "$QUEUE_URL" --message-body '{"order":1}'
// --message-attributes 'idem-id={DataType=String,StringValue=order-1}'`.
use idem::consumer::sqs::{SqsConfig, SqsConsumer, aws_sdk_sqs};
use idem::consumer::{Adapter, Consumer, Message};
use idem::{Idempotency, RedisStore};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis).await?).build();
    // The 5th failed run of one order's handler dead-letters it.
    let consumer = Consumer::new(idem, "orders.charge").max_failures(5);

    let aws = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let queue_url = std::env::var("QUEUE_URL")?;
    // Long polls of 20 s; a visibility timeout of 60 s, extended every 20 s
    // while a charge runs. Dead letters (with idem's reason as message
    // attributes) go to the queue that the redrive policy names.
    let cfg = SqsConfig::new(queue_url)
        .wait(Duration::from_secs(20))
        .visibility_timeout(Duration::from_secs(60));
    let sqs = SqsConsumer::new(aws_sdk_sqs::Client::new(&aws), cfg).await?;

    let charge = |m: Message| async move {
        // Your side effect: runs once per `idem-id` attribute (else once per
        // SQS message id; on a FIFO queue, per deduplication id).
        let order = String::from_utf8_lossy(m.payload());
        println!("charging {}: {order}", m.id().unwrap_or("?"));
        Ok::<_, std::io::Error>(())
    };
    // Ctrl-C stops receiving, lets running handlers finish, then returns.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    sqs.run(&consumer, &charge, shutdown).await?;
    Ok(())
}
