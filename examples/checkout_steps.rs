//! Durable steps: a checkout of three side effects (reserve stock, charge
//! the card, send the e-mail) that **crashes** after the charge and
//! **resumes** in another process without reserving or charging again.
//!
//! ```text
//! cargo run --example checkout_steps                                   # Redis on 127.0.0.1:6379
//! REDIS_URL=redis://127.0.0.1:6380/ cargo run --example checkout_steps
//! ```
//!
//! 1. The example starts a copy of itself (a separate process) that runs
//!    the checkout: `reserve` and `charge` finish and are recorded under the
//!    idempotency key, then the process aborts before `email`, as a
//!    `kill -9` or an OOM kill would stop it.
//! 2. This process runs the same checkout with the same key. The dead
//!    holder's lease runs out (1 s here), the call takes the key over
//!    (`Outcome::Recovered`), gets `reserve` and `charge` back from the
//!    record without running them, and runs only `email`.
//! 3. A retry of the request replays the stored receipt (`Replayed`).
//!
//! The charge passes `s.key("charge")` to the payment provider (a tiny one
//! kept in Redis here), which honours idempotency keys: even a crash in the
//! middle of the charge step cannot charge twice.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

use idem::{Error, Idempotency, Outcome, RedisStore, Steps};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Receipt {
    hold: String,
    charge: String,
    emailed: bool,
}

/// The payment provider: one charge per idempotency key, and the same
/// charge id for every request that repeats the key.
const CHARGE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 3600) then
  redis.call('INCR', KEYS[2])
end
return redis.call('GET', KEYS[1])";

async fn checkout(
    s: &Steps,
    order: &str,
    pay: &redis::aio::MultiplexedConnection,
    crash_after_charge: bool,
) -> Result<Receipt, Error> {
    let who = std::process::id();
    let hold = s
        .step("reserve", async || {
            println!("  [pid {who}] reserve: holding 1 × sku-42 for {order}");
            Ok::<_, Error>(format!("hold-{order}"))
        })
        .await?;
    let key = s.key("charge");
    let charge = s
        .step("charge", async || {
            println!("  [pid {who}] charge: 42.00 EUR, provider idempotency key {key}");
            redis::Script::new(CHARGE)
                .key(format!("provider:charge:{key}"))
                .key(format!("provider:charges:{order}"))
                .arg(format!("ch_{who}"))
                .invoke_async::<String>(&mut pay.clone())
                .await
                .map_err(|e| Error::unavailable("claim", format!("payment provider: {e}")))
        })
        .await?;
    if crash_after_charge {
        println!("  [pid {who}] *** crash: the process aborts before the e-mail ***");
        std::process::abort();
    }
    s.step("email", async || {
        println!("  [pid {who}] email: receipt for {order} sent");
        Ok::<_, Error>(())
    })
    .await?;
    Ok(Receipt {
        hold,
        charge,
        emailed: true,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let store = RedisStore::connect(&url).await?;
    let idem = Idempotency::builder(store)
        .namespace("checkout-example")
        .lease(Duration::from_secs(1))
        .build();
    let pay = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;

    // The child: run the checkout and crash after the charge.
    if let Some(order) = std::env::args().nth(1).filter(|a| a.starts_with("order-")) {
        let _: Result<Receipt, Error> = idem
            .call("checkout", &order)
            .run_steps(async |s| checkout(s, &order, &pay, true).await)
            .await;
        // Not reached: the child aborts inside the checkout.
        std::process::exit(1);
    }

    let order = format!("order-{}", std::process::id());
    println!("1. a worker process takes order {order} and dies half-way:");
    let status = std::process::Command::new(std::env::current_exe()?)
        .arg(&order)
        .env("REDIS_URL", &url)
        .status()?;
    println!("   worker exited: {status}");
    if let Some(info) = idem.inspect("checkout", &order).await? {
        println!(
            "   the key is pending (attempt {}), finished steps recorded: {:?}",
            info.attempt.unwrap_or(1),
            info.steps
        );
    }

    println!("2. this process retries the order (same key):");
    let (receipt, outcome) = idem
        .call("checkout", &order)
        .wait(Duration::from_secs(10))
        .run_steps_outcome(async |s| {
            let r = checkout(s, &order, &pay, false).await?;
            println!("   {} finished steps replayed, not run again", s.replayed());
            Ok::<_, Error>(r)
        })
        .await?;
    println!("   outcome: {outcome:?}, receipt: {receipt:?}");
    assert_eq!(outcome, Outcome::Recovered);

    println!("3. the client retries once more:");
    let (again, outcome) = idem
        .call("checkout", &order)
        .run_steps_outcome(async |s| checkout(s, &order, &pay, false).await)
        .await?;
    println!("   outcome: {outcome:?}, receipt: {again:?}");

    let charges: u32 = redis::cmd("GET")
        .arg(format!("provider:charges:{order}"))
        .query_async(&mut pay.clone())
        .await?;
    println!("the provider charged order {order} {charges} time(s)");
    assert_eq!(charges, 1);
    Ok(())
}
