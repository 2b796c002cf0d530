//! Charges each order of a Redis stream once, whatever the stream redelivers.
//!
//! Reads the stream `orders` (first argument) in the consumer group
//! `billing` until Ctrl-C or SIGTERM. An entry is an order event: the field
//! `payload` holds `{"order":"o-1","amount":500,"sent_at":…}`, the field `id`
//! the producer's event id. Each charge is a line appended to the ledger
//! file (second argument, default `orders-ledger.txt`), which outlives the
//! process: a rerun shows whether anything was ever charged twice.
//!
//! ```sh
//! redis-cli XADD orders '*' id evt-1 payload '{"order":"o-1","amount":500,"sent_at":1}'
//! redis-cli XADD orders '*' id evt-1 payload '{"order":"o-1","amount":500,"sent_at":1}' # a producer retry
//! redis-cli XADD orders '*' id evt-9 payload '{"order":"o-1","amount":500,"sent_at":2}' # re-published
//! redis-cli XADD orders '*' id evt-2 payload '{"order":"o-2","amount":-5,"sent_at":1}'  # never chargeable
//! cargo run --example orders_consumer --features redis-streams   # charges o-1 once; Ctrl-C stops it
//! ```
//!
//! idem's records go to the Redis at `REDIS_URL` (default 127.0.0.1:6379).
//! `tests/it/orders_consumer_example.rs` feeds this program from a Python
//! producer and SIGKILLs it mid-batch: each order is still charged once.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "it prints")]
use idem::consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem::consumer::{Adapter, Consumer, ErrorClass, KeyDeriver, KeySource, Message, PollReport};
use idem::{Idempotency, RedisStore};
use serde::Deserialize;
use std::path::PathBuf;
use std::pin::pin;
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};

/// idem's lease: how long a killed consumer's keys stay held before a
/// redelivery takes over (`recovered`). Renewed while a handler runs.
const LEASE: Duration = Duration::from_secs(3);
/// How long a dead consumer's entries wait before another one claims them.
const REDELIVER_AFTER: Duration = Duration::from_secs(1);
/// The pretend payment provider's latency per charge.
const PROVIDER_LATENCY: Duration = Duration::from_millis(50);

#[derive(Debug, Deserialize)]
struct Order {
    order: String,
    amount: i64,
}

/// Why a charge failed: `Invalid` is final (dead-lettered at once), a
/// ledger failure is worth another delivery.
#[derive(Debug)]
enum ChargeError {
    Invalid(String),
    Ledger(String),
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ChargeError::Invalid(why) | ChargeError::Ledger(why)) = self;
        f.write_str(why)
    }
}

/// The ledger of charges: an append-only file, one `key order amount` line
/// per charge, on disk before the charge counts as done (created at the
/// first charge).
#[derive(Debug, Clone)]
pub(crate) struct Ledger(pub(crate) PathBuf);

impl Ledger {
    /// Every charge so far: (key, order, amount).
    pub(crate) fn charges(&self) -> std::io::Result<Vec<(String, String, i64)>> {
        let text = match std::fs::read_to_string(&self.0) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            read => read?,
        };
        let line = |l: &str| {
            let mut f = l.split(' ');
            let (key, order, amount) = (f.next()?, f.next()?, f.next()?.parse().ok()?);
            Some((key.to_owned(), order.to_owned(), amount))
        };
        Ok(text.lines().filter_map(line).collect())
    }

    /// Charges `order` under `key`, unless a charge under `key` is there.
    ///
    /// Like a payment provider's idempotency key, the key goes with the
    /// charge: a consumer killed after charging but before idem stored the
    /// result leaves the key to the next delivery once its lease ends
    /// (`recovered`), and that run cannot tell itself from a first one. idem
    /// keeps this question rare: duplicates replay without reaching it.
    fn charge(&self, key: &str, order: &Order) -> std::io::Result<bool> {
        use std::io::Write;
        if self.charges()?.iter().any(|(k, _, _)| k == key) {
            return Ok(false);
        }
        let mut f = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.0)?;
        // One write per line: concurrent appenders never interleave a line.
        f.write_all(format!("{key} {} {}\n", order.order, order.amount).as_bytes())?;
        f.sync_data()?;
        Ok(true)
    }
}

/// Consumes `stream` into `ledger` until Ctrl-C or SIGTERM.
pub(crate) async fn run(stream: &str, ledger: Ledger) -> Result<(), Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let idem = Idempotency::builder(RedisStore::connect(&redis_url).await?)
        .namespace("orders-example")
        .lease(LEASE)
        .build();
    let consumer = Consumer::new(idem, "orders.charge")
        // One order, one charge: the key is the order itself (its payload
        // without the timestamp), not the event id, so a re-published order
        // is a duplicate too.
        .keys(KeySource::Payload(KeyDeriver::new().exclude("/sent_at")?))
        .max_failures(3)
        .backoff(Duration::from_millis(200), Duration::from_secs(2))
        .classify(|e: &ChargeError| {
            ErrorClass::from_retryable(!matches!(e, ChargeError::Invalid(_)))
        });
    // One consumer name per process: a restarted one claims what its dead
    // predecessor held once it has been idle for REDELIVER_AFTER.
    let name = format!("billing-{}", std::process::id());
    let config = StreamsConfig::new(stream, "billing", name).claim_idle(REDELIVER_AFTER);
    let broker = RedisStreamsConsumer::connect(&redis_url, config).await?;
    broker.ensure_group().await?;

    // The body idem runs at most once per key: a duplicate is acked with
    // the stored receipt and never gets here.
    let charge = |m: Message| {
        let (ledger, key) = (ledger.clone(), consumer.key_of(&m));
        async move {
            let key = key.map_err(|e| ChargeError::Invalid(e.to_string()))?;
            let order: Order = m.json().map_err(|e| ChargeError::Invalid(e.to_string()))?;
            if order.amount <= 0 {
                return Err(ChargeError::Invalid(format!("amount {}", order.amount)));
            }
            tokio::time::sleep(PROVIDER_LATENCY).await;
            let receipt = format!("receipt-{}", order.order);
            let charged = tokio::task::spawn_blocking(move || ledger.charge(&key, &order));
            let new = charged.await.map_err(std::io::Error::other).and_then(|r| r);
            let new = new.map_err(|e| ChargeError::Ledger(e.to_string()))?;
            let what = if new { "charged" } else { "charged already" };
            println!("  {:<24} {receipt:<28} {what}", m.id().unwrap_or("(no id)"));
            Ok(receipt)
        }
    };

    // Ctrl-C and SIGTERM, caught from here on: a stop before the first
    // poll is still a clean one.
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut stop = pin!(async move {
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    });
    println!("consuming {stream} until Ctrl-C or SIGTERM");
    let (mut total, mut failures, mut stopping) = (PollReport::default(), 0, false);
    while !stopping {
        // A stop lets the poll in flight finish: its batch is settled, not
        // left half done for the next process to recover.
        let mut poll = pin!(broker.poll(&consumer, &charge));
        let polled = tokio::select! {
            polled = &mut poll => polled,
            () = &mut stop => {
                stopping = true;
                poll.await
            }
        };
        match polled {
            Ok(r) if r.fetched == 0 => failures = 0,
            Ok(r) => {
                failures = 0;
                println!(
                    "batch of {} ({} redelivered): {} acked, {} nacked, {} dead-lettered",
                    r.fetched, r.redelivered, r.acked, r.nacked, r.dead_lettered
                );
                total.add(r);
            }
            // Redis down: the entries stay in the stream; try again later.
            Err(e) => {
                failures += 1;
                eprintln!("poll failed ({e}); again after a pause");
                tokio::time::sleep(consumer.backoff_for(failures)).await;
            }
        }
    }
    let (n, acked, dead) = (total.fetched, total.acked, total.dead_lettered);
    let (path, charges) = (ledger.0.display(), ledger.charges()?.len());
    let tail = format!("{dead} dead-lettered; {path} holds {charges} charges");
    println!("summary: {n} messages, {acked} acked (duplicates replayed), {tail}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let stream = args.next().unwrap_or_else(|| "orders".into());
    let ledger = args.next().unwrap_or_else(|| "orders-ledger.txt".into());
    run(&stream, Ledger(ledger.into())).await
}
