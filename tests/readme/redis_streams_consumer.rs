// Charges each order added to the stream `orders` once, whatever Redis
// redelivers. Cargo.toml: `idem = { version = "0.1", features =
// ["redis-streams"] }`, `tokio = { version = "1", features = ["full"] }`.
// Needs Redis on 6379 (or `REDIS_URL`); add an order with
// `redis-cli XADD orders '*' id order-1 payload '{"order":1}'`.
use idem::consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem::consumer::{Adapter, Consumer, Message};
use idem::{Idempotency, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis).await?).build();
    // The 5th failed run of one order's handler dead-letters it.
    let consumer = Consumer::new(idem, "orders.charge").max_failures(5);

    // Group `billing`, consumer `billing-1` (one name per process); dead
    // letters go to the stream `orders:dead`, with idem's reason as fields.
    let cfg =
        StreamsConfig::new("orders", "billing", "billing-1").dead_letter_stream("orders:dead");
    let stream = RedisStreamsConsumer::connect(&redis, cfg).await?;
    stream.ensure_group().await?;

    let charge = |m: Message| async move {
        // Your side effect: runs once per entry `id`.
        let order = String::from_utf8_lossy(m.payload());
        println!("charging {}: {order}", m.id().unwrap_or("?"));
        Ok::<_, std::io::Error>(())
    };
    // Ctrl-C stops fetching, lets running handlers finish, then returns.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    stream.run(&consumer, &charge, shutdown).await?;
    Ok(())
}
