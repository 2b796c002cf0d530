// The same on Redis, without a database: the order's result and its
// `orders.created` message are stored by one script, so both or neither;
// a relay then publishes the message to the Redis stream `orders.created`.
// Cargo.toml: `idem = { version = "0.1", features = ["redis-streams"] }`,
// `tokio = { version = "1", features = ["full"] }`, `serde_json = "1"`.
// Needs Redis at `REDIS_URL`; watch with `redis-cli XRANGE orders.created - +`.
use idem::outbox::{self, RedisRelay, RedisStreamsSink};
use idem::{Error, Idempotency, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let store = RedisStore::connect(&url).await?;
    let idem = Idempotency::builder(store.clone())
        .namespace("shop")
        .build();

    // request-7 arrives twice: one order, one message.
    for request in ["request-7", "request-8", "request-7"] {
        let order: Result<String, Error> = idem
            .call("orders.create", request)
            .run(|| async {
                let order = format!("order-{request}"); // … the order's own effect …
                let event = serde_json::json!({ "order": order, "amount": 500 });
                outbox::stage("orders.created", &order, &event)?; // stored with the result
                Ok(order)
            })
            .await;
        println!("{request}: {order:?}");
    }

    // One relay drains the outbox stream (more stand by), in order per
    // order id, deleting each message once the sink confirmed it.
    let relay = RedisRelay::new(&store, RedisStreamsSink::connect(&url).await?);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = relay.run(shutdown).await;
    println!("relayed {} message(s)", report.sent);
    Ok(())
}
