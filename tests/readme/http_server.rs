// An axum service whose `POST /payments` runs once per `Idempotency-Key`:
// a retry gets the stored response with `Idempotent-Replayed: true`.
// Cargo.toml: `idem = { version = "0.1", features = ["http"] }`, `axum =
// "0.8"`, `tokio = { version = "1", features = ["full"] }`. Try it twice:
// `curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: k1' -d '{}'`
use axum::{Router, routing::post};
use idem::http::IdempotencyLayer;
use idem::{Idempotency, MemoryStore};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // MemoryStore holds in one process; RedisStore or PgStore across instances.
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let charges = Arc::new(AtomicU64::new(0));
    let charge = move || {
        let charges = charges.clone();
        async move {
            // Your side effect: runs once per key.
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            format!("charge #{n}\n")
        }
    };
    let app = Router::new()
        .route("/payments", post(charge))
        .layer(IdempotencyLayer::new(idem).require_key(true)); // 400 without a key
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
