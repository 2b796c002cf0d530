//! The idem tour: executed, replayed, in progress, fingerprint mismatch, and
//! an error that releases the key.
//!
//! ```text
//! cargo run --example quickstart                                # embedded MemoryStore
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example quickstart  # against Redis
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

use idem::{Error, Idempotency, MemoryStore, Outcome, RedisStore, idempotent};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    order_id: String,
    amount: u64,
    charge_no: u32,
}

#[derive(Debug)]
enum PaymentError {
    Declined,
    Idem(Error),
}

impl From<Error> for PaymentError {
    fn from(e: Error) -> Self {
        PaymentError::Idem(e)
    }
}

impl std::error::Error for PaymentError {}

impl std::fmt::Display for PaymentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PaymentError::Declined => write!(f, "card declined"),
            PaymentError::Idem(e) => write!(f, "{e}"),
        }
    }
}

/// Counts real charges, to show which calls ran the body.
static CHARGES: AtomicU32 = AtomicU32::new(0);

/// The side effect we must not repeat: runs once per order id.
#[idempotent(key = order_id, ttl = "1h", fingerprint = amount)]
async fn charge(order_id: &str, amount: u64) -> Result<Receipt, PaymentError> {
    if amount == 0 {
        return Err(PaymentError::Declined);
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the payment provider
    let charge_no = CHARGES.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(Receipt {
        order_id: order_id.to_owned(),
        amount,
        charge_no,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = format!("{:x}", std::process::id());
    let builder = match std::env::var("REDIS_URL") {
        Ok(url) => {
            println!("store: Redis at {url}");
            Idempotency::builder(RedisStore::connect(&url).await?)
        }
        Err(_) => {
            println!("store: embedded MemoryStore (set REDIS_URL to use Redis)");
            Idempotency::builder(MemoryStore::new())
        }
    };
    let idem = builder.namespace("quickstart").build();
    idem.install()?;
    let order = format!("order-{run}");

    // 1. First delivery: the body runs.
    let r = charge(&order, 500).await?;
    println!("1. executed:  {r:?}");

    // 2. Redelivery: the stored receipt comes back, the body does not run.
    let r = charge(&order, 500).await?;
    println!(
        "2. replayed:  {r:?}  (charges so far: {})",
        CHARGES.load(Ordering::SeqCst)
    );

    // 3. Two deliveries at once: one runs, the other is told to retry.
    let other = format!("order-{run}-b");
    let (a, b) = tokio::join!(charge(&other, 700), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        charge(&other, 700).await
    });
    println!("3. in flight: first -> {:?}", a.map(|r| r.charge_no));
    match b {
        Err(PaymentError::Idem(Error::InProgress { retry_after })) => {
            // Rounded as people read durations: "29.9 s", not "29.948439359s".
            println!(
                "   in flight: second -> InProgress, retry after {:.1} s",
                retry_after.as_secs_f64()
            )
        }
        other => println!("   in flight: second -> {other:?}"),
    }

    // 4. Same key, different payload: refused rather than replaying the wrong receipt.
    match charge(&order, 999).await {
        Err(PaymentError::Idem(Error::FingerprintMismatch)) => {
            println!("4. mismatch:  same order id with amount 999 -> FingerprintMismatch")
        }
        other => println!("4. mismatch:  unexpected {other:?}"),
    }

    // 5. An error releases the key: the next call runs the body again.
    let declined = format!("order-{run}-c");
    let first = idem
        .call("quickstart.pay", &declined)
        .run_outcome(|| async { Err::<u32, PaymentError>(PaymentError::Declined) })
        .await;
    let second = idem
        .call("quickstart.pay", &declined)
        .run_outcome(|| async { Ok::<u32, PaymentError>(1) })
        .await?;
    println!(
        "5. released:  first -> {}, retry -> {:?}",
        first.err().map_or("ok".to_owned(), |e| e.to_string()),
        second.1
    );
    assert_eq!(second.1, Outcome::Executed);

    println!(
        "done: {} real charges for 2 orders and 5 deliveries",
        CHARGES.load(Ordering::SeqCst)
    );
    Ok(())
}
