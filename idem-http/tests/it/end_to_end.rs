//! The whole path over real sockets and a real Redis: retrying
//! `idem-client`s sharing one key, the layer, and an `#[idempotent]`
//! service function behind the handler.

use crate::support;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_client::{Client, RetryPolicy};
use idem_core::{Error, Idempotency};
use idem_http::IdempotencyLayer;
use idem_macros::idempotent;
use idem_redis::RedisStore;
use idem_testkit::RedisServer;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    order_id: String,
    cents: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: u64,
}

#[derive(Debug)]
struct PaymentError(String);

impl From<Error> for PaymentError {
    fn from(e: Error) -> Self {
        PaymentError(e.to_string())
    }
}

#[derive(Clone)]
struct Payments {
    idem: Idempotency,
    charges: Arc<AtomicUsize>,
}

impl Payments {
    /// The side effect: one real charge per order, whatever reaches it.
    #[idempotent(key = charge.order_id, scope = "payments.charge", using = self.idem)]
    async fn charge(&self, charge: Charge) -> Result<Receipt, PaymentError> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Receipt {
            id: format!("rcpt-{n}"),
            cents: charge.cents,
        })
    }
}

async fn create(
    State(p): State<Payments>,
    Json(charge): Json<Charge>,
) -> Result<(StatusCode, Json<Receipt>), (StatusCode, String)> {
    p.charge(charge)
        .await
        .map(|r| (StatusCode::CREATED, Json(r)))
        .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_retrying_clients_one_key_one_charge() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let idem = Idempotency::builder(store).namespace("e2e").build();
    let payments = Payments {
        idem: idem.clone(),
        charges: Arc::new(AtomicUsize::new(0)),
    };
    let app = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new(idem).require_key(true))
        .with_state(payments.clone());
    let base = support::serve(app).await;

    let key = uuid_like();
    let body = Charge {
        order_id: "order-77".into(),
        cents: 1999,
    };
    let start = Arc::new(tokio::sync::Barrier::new(8));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            // Separate clients: separate connection pools, as separate processes would have.
            let client = Client::builder(base.as_str())
                .retry(
                    RetryPolicy::default()
                        .max_retries(20)
                        .initial_backoff(Duration::from_millis(50))
                        .max_backoff(Duration::from_millis(200)),
                )
                .build()
                .expect("client");
            let (key, body, start) = (key.clone(), body.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                client
                    .post_with_key::<_, Receipt>("/payments", &key, &body)
                    .await
            })
        })
        .collect();
    let mut receipts = Vec::new();
    for c in clients {
        let r = c
            .await
            .expect("join")
            .expect("every client gets the receipt");
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.key, key);
        receipts.push(r);
    }
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1, "charged once");
    assert!(receipts.iter().all(|r| r.value == receipts[0].value));
    assert_eq!(receipts[0].value.cents, 1999);
    assert_eq!(receipts.iter().filter(|r| !r.replayed).count(), 1);
    assert!(
        receipts.iter().any(|r| r.attempts > 1),
        "duplicates in flight were told to retry (409) and did"
    );

    // A later retry of the same operation replays without charging.
    let late = Client::builder(base.as_str()).build().expect("client");
    let r = late
        .post_with_key::<_, Receipt>("/payments", &key, &body)
        .await
        .expect("replay");
    assert!(r.replayed);
    assert_eq!(r.value, receipts[0].value);
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
}

fn uuid_like() -> String {
    format!("e2e-{:032x}", std::process::id() as u128 * 7919)
}
