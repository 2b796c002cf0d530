// A sink of your own: the relay appends each message to a file, one JSON
// line per message, and a message counts as sent once its line is on disk.
// Cargo.toml: `idem = "0.1"`, `tokio = { version = "1", features = ["full"]
// }`, `serde_json = "1"` (no `async-trait`: idem re-exports it). Needs Redis
// at `REDIS_URL`; watch with `tail -f outbox.jsonl`.
use idem::outbox::{self, OutboxMessage, RedisRelay, Sink, SinkError};
use idem::{Error, Idempotency, RedisStore};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

/// Appends messages to a file and answers `Ok` only after `fsync`: the
/// relay deletes a message from the outbox once its sink said `Ok`.
struct FileSink {
    path: String,
    file: Mutex<tokio::fs::File>,
}

impl FileSink {
    async fn open(path: &str) -> std::io::Result<FileSink> {
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await?;
        Ok(FileSink {
            path: path.to_owned(),
            file: Mutex::new(file),
        })
    }
}

#[idem::async_trait] // the trait is `#[async_trait]`; idem re-exports the attribute
impl Sink for FileSink {
    // One result per message, in the batch's order. A batch never holds two
    // messages of one key: the key's next message waits for this answer.
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let mut lines = Vec::new();
        let mut results = Vec::with_capacity(batch.len());
        for m in batch {
            match serde_json::from_slice::<serde_json::Value>(&m.payload) {
                Ok(payload) => {
                    // The id is the same on every re-send: readers de-duplicate on it.
                    let line = serde_json::json!({
                        "id": m.id, "topic": m.topic, "key": m.key, "payload": payload,
                    });
                    lines.extend_from_slice(format!("{line}\n").as_bytes());
                    results.push(Ok(()));
                }
                // It would fail again: parked with this reason for an operator
                // (`idem outbox list|retry|drop`), and its key waits behind it.
                Err(e) => results.push(Err(SinkError::refused(format!("not JSON: {e}")))),
            }
        }
        let mut file = self.file.lock().await;
        let written = async {
            file.write_all(&lines).await?;
            file.sync_data().await // durable before `Ok`
        };
        match written.await {
            Ok(()) => results,
            // Not known to be on disk: the whole batch is sent again later,
            // under the same ids, after a backoff.
            Err(e) => batch
                .iter()
                .map(|_| {
                    Err(SinkError::unavailable(format!("writing {}", self.path))
                        .with_source(e.to_string()))
                })
                .collect(),
        }
    }

    // What the relay's log lines name.
    fn describe(&self) -> String {
        format!("file {}", self.path)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1/".into());
    let store = RedisStore::connect(&url).await?;
    let idem = Idempotency::builder(store.clone())
        .namespace("shop")
        .build();

    let order: Result<String, Error> = idem
        .call("orders.create", "request-7")
        .run(|| async {
            let event = serde_json::json!({ "order": "order-7", "amount": 500 });
            outbox::stage("orders.created", "order-7", &event)?; // stored with the result
            Ok("order-7".to_owned())
        })
        .await;
    println!("request-7: {order:?}");

    let relay = RedisRelay::new(&store, FileSink::open("outbox.jsonl").await?);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let report = relay.run(shutdown).await;
    println!("relayed {} message(s)", report.sent);
    Ok(())
}
