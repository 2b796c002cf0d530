// Charges each order on the topic `orders` once, whatever Kafka re-reads.
// Cargo.toml: `idem = { version = "0.1", features = ["kafka"] }`, `tokio =
// { version = "1", features = ["full"] }` (rdkafka builds librdkafka: gcc,
// make). Needs Redis on 6379 and Kafka on 9092 (or `REDIS_URL`,
// `KAFKA_BROKERS`); produce an order with
// `echo '{"order":1}' | kcat -P -b 127.0.0.1:9092 -t orders -H idempotency-key=order-1`.
use idem::consumer::kafka::{KafkaConfig, KafkaConsumer};
use idem::consumer::{Consumer, Message};
use idem::{Idempotency, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis).await?).build();
    // The 5th failed run of one order's handler dead-letters it.
    let consumer = Consumer::new(idem, "orders.charge").max_failures(5);

    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let kafka = KafkaConsumer::connect(
        KafkaConfig::new(brokers, "billing", ["orders"])
            .retry_topic("orders.retry") // optional: after 3 failed runs in process
            .dead_letter_topic("orders.DLT") // the default, `<topic>.DLT`
            .set("session.timeout.ms", "10000"), // any librdkafka property
    )?;

    let charge = |m: Message| async move {
        // Your side effect: runs once per `idempotency-key` header.
        let order = String::from_utf8_lossy(m.payload());
        println!("charging {}: {order}", m.id().unwrap_or("?"));
        Ok::<_, std::io::Error>(())
    };
    // Ctrl-C drains: running handlers finish, decided offsets are committed.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = kafka.run(&consumer, &charge, shutdown).await?;
    println!("{report:?}"); // acked, replayed, retried, dead-lettered, …
    // Leaves the group before the process exits: the other members get
    // the partitions now, not after `session.timeout.ms`.
    kafka.close().await;
    Ok(())
}
