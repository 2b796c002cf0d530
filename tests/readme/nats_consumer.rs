// Charges each order published on `ORDERS.new` once, whatever JetStream
// redelivers. Cargo.toml: `idem = { version = "0.1", features = ["nats"] }`,
// `tokio = { version = "1", features = ["full"] }`. Needs Redis on 6379 (or
// `REDIS_URL`) and `nats-server -js` on 4222; publish an order with
// `nats pub ORDERS.new '{"order":1}' -H Nats-Msg-Id:order-1`.
use idem::consumer::nats::async_nats::{self, jetstream};
use idem::consumer::nats::{NatsConfig, NatsConsumer, pull_config};
use idem::consumer::{Adapter, Consumer, Message};
use idem::{Idempotency, RedisStore};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis).await?).build();
    // The 5th failed run of one order's handler dead-letters it.
    let consumer = Consumer::new(idem, "orders.charge").max_failures(5);

    let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
    // One stream keeps the orders and their dead letters...
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["ORDERS.>".into()],
            ..Default::default()
        })
        .await?;
    // ...and the consumer reads only the orders: a dead-letter subject it
    // would receive itself is refused (every dead letter would come back).
    let mut config = pull_config("billing", Duration::from_secs(30));
    config.filter_subject = "ORDERS.new".into();
    let pull = stream.get_or_create_consumer("billing", config).await?;
    let cfg = NatsConfig::new().dead_letter_subject("ORDERS.dead");
    let nats = NatsConsumer::with_jetstream(&js, pull, cfg).await?;

    let charge = |m: Message| async move {
        // Your side effect: runs once per `Nats-Msg-Id`.
        let order = String::from_utf8_lossy(m.payload());
        println!("charging {}: {order}", m.id().unwrap_or("?"));
        Ok::<_, std::io::Error>(())
    };
    // Ctrl-C stops fetching, lets running handlers finish, then returns.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    nats.run(&consumer, &charge, shutdown).await?;
    Ok(())
}
