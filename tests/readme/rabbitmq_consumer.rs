// Charges each order on the queue `orders` once, whatever RabbitMQ
// redelivers. Cargo.toml: `idem = { version = "0.1", features = ["rabbitmq"] }`,
// `tokio = { version = "1", features = ["full"] }`. Needs Redis on 6379 and
// RabbitMQ on 5672 (or `REDIS_URL`, `AMQP_URL`); publish an order with
// `rabbitmqadmin publish routing_key=orders payload='{"order":1}' properties='{"message_id":"order-1"}'`.
use idem::consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue, lapin};
use idem::consumer::{Adapter, Consumer, Message};
use idem::{Idempotency, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis).await?).build();
    // The 5th failed run of one order's handler dead-letters it.
    let consumer = Consumer::new(idem, "orders.charge").max_failures(5);

    let amqp = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://127.0.0.1:5672/%2f".into());
    let conn = lapin::Connection::connect(&amqp, Default::default()).await?;
    let channel = conn.create_channel().await?;
    // A quorum queue whose dead letters the adapter publishes itself, with
    // idem's reason as headers, through `orders.dlx` to `orders.dead`.
    declare_queue(&channel, "orders", "orders.dlx", "orders.dead").await?;
    let cfg = RabbitConfig::new("orders").dead_letter_exchange("orders.dlx");
    let rabbit = RabbitConsumer::new(channel, cfg).await?;

    let charge = |m: Message| async move {
        // Your side effect: runs once per AMQP `message_id`.
        let order = String::from_utf8_lossy(m.payload());
        println!("charging {}: {order}", m.id().unwrap_or("?"));
        Ok::<_, std::io::Error>(())
    };
    // Ctrl-C stops fetching, lets running handlers finish, then returns.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    rabbit.run(&consumer, &charge, shutdown).await?;
    Ok(())
}
