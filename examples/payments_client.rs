//! Several independent, retrying clients send the *same* payment with the
//! *same* `Idempotency-Key` at the same moment — as happens when a request
//! times out and several replicas, or a user's double click, retry it. The
//! card is charged once and every client gets the same receipt.
//!
//! ```text
//! # everything in one process (spawns the payments_server router on a free port):
//! cargo run --example payments_client --features client,http
//!
//! # against a running server:
//! cargo run --example payments_server --features http &
//! SERVER_URL=http://127.0.0.1:3000 cargo run --example payments_client --features client
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

use idem::client::{Client, ClientError, RetryPolicy};
use serde::{Deserialize, Serialize};
use std::time::Duration;

// The same router as `cargo run --example payments_server`, served in
// process when SERVER_URL is not set.
#[cfg(feature = "http")]
#[allow(dead_code)]
#[path = "payments_server.rs"]
mod server;

/// How many clients race with the same key.
const CLIENTS: usize = 6;

#[derive(Debug, Clone, Serialize)]
struct ChargeRequest {
    order_id: String,
    amount_cents: u64,
    currency: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct Receipt {
    receipt_id: String,
    order_id: String,
    amount_cents: u64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct Stats {
    charges: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .init();

    let base = match std::env::var("SERVER_URL") {
        Ok(url) => url,
        Err(_) => spawn_server().await?,
    };
    println!("payments server: {base}");

    let charges_before = charges(&base).await?;

    // One key for the one logical operation, shared by every client.
    let key = idem::client::new_key();
    let order = ChargeRequest {
        order_id: format!("order-{}", &key[..8]),
        amount_cents: 1999,
        currency: "EUR".to_owned(),
    };
    println!(
        "{CLIENTS} clients charge {} ({} cents) with Idempotency-Key {key}",
        order.order_id, order.amount_cents
    );

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        // Independent clients (own connection pools), as separate replicas would be.
        let client = Client::builder(base.clone())
            .retry(
                RetryPolicy::default()
                    .max_retries(6)
                    .initial_backoff(Duration::from_millis(100))
                    .max_backoff(Duration::from_secs(2)),
            )
            .build()?;
        let (key, order, barrier) = (key.clone(), order.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let result = client
                .post_with_key::<_, Receipt>("/payments", &key, &order)
                .await;
            (i, result)
        }));
    }

    let mut receipts = Vec::new();
    for task in tasks {
        let (i, result) = task.await?;
        match result {
            Ok(r) => {
                println!(
                    "client {i}: {} {} after {} attempt(s){}",
                    r.status.as_u16(),
                    r.value.receipt_id,
                    r.attempts,
                    if r.replayed {
                        " (replayed)"
                    } else {
                        " (executed)"
                    },
                );
                receipts.push(r.value);
            }
            Err(e) => print_failure(i, &e),
        }
    }

    let charged = charges(&base).await? - charges_before;
    let all_same = receipts.windows(2).all(|w| w[0] == w[1]);
    println!();
    println!("card charged {charged} time(s) for {CLIENTS} concurrent clients");
    match receipts.first() {
        Some(receipt) if all_same && receipts.len() == CLIENTS && charged == 1 => {
            println!(
                "every client got the same receipt: {} for {} {} cents",
                receipt.receipt_id, receipt.currency, receipt.amount_cents
            );
            Ok(())
        }
        _ => Err(format!(
            "expected one charge and {CLIENTS} identical receipts, got {charged} charge(s) and {} receipt(s) (identical: {all_same})",
            receipts.len()
        )
        .into()),
    }
}

fn print_failure(i: usize, e: &ClientError) {
    println!(
        "client {i}: failed after {} attempt(s): {e}",
        e.attempts().unwrap_or(0)
    );
}

/// How many charges the server has made so far (`GET /stats`).
async fn charges(base: &str) -> Result<u64, Box<dyn std::error::Error>> {
    let stats: Stats = reqwest::get(format!("{base}/stats"))
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(stats.charges)
}

/// Serves the payments_server router on a free port of 127.0.0.1.
#[cfg(feature = "http")]
async fn spawn_server() -> Result<String, Box<dyn std::error::Error>> {
    let idem = server::idempotency_from_env().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, server::app(idem)).await {
            eprintln!("in-process server stopped: {e}");
        }
    });
    Ok(format!("http://{addr}"))
}

#[cfg(not(feature = "http"))]
async fn spawn_server() -> Result<String, Box<dyn std::error::Error>> {
    Err("SERVER_URL is not set and this build has no `http` feature to serve the API in process: \
         run `cargo run --example payments_client --features client,http`, or start \
         `cargo run --example payments_server --features http` and set SERVER_URL=http://127.0.0.1:3000"
        .into())
}
