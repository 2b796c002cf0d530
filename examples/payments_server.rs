//! A payments API that charges a card at most once per request, however
//! often clients retry.
//!
//! Two layers of protection, both backed by the same `idem` runtime:
//!
//! * `IdempotencyLayer` in front of the routes: a `POST /payments` must carry
//!   an `Idempotency-Key`; a retry with the same key gets the first response
//!   again (`Idempotent-Replayed: true`), a duplicate still in flight `409` +
//!   `Retry-After`, a key reused with another body `422`. Each
//!   `Authorization` value has its own key space; a client that disconnects
//!   does not stop a charge half-way: the retry gets its receipt.
//! * `#[idempotent]` on the service function that talks to the card
//!   processor, keyed by the order id: even two requests with *different*
//!   idempotency keys for the same order charge it once.
//!
//! ```text
//! cargo run --example payments_server --features http    # REDIS_URL, ADDR=127.0.0.1:3000
//!
//! curl -i -X POST http://127.0.0.1:3000/payments \
//!      -H 'Idempotency-Key: 8e0f6c1a-3f4b-4c1e-9a59-0d1c2b3a4f5e' \
//!      -H 'Content-Type: application/json' \
//!      -d '{"order_id":"order-1","amount_cents":1999,"currency":"EUR"}'
//! ```
//! Without `REDIS_URL` the in-process `MemoryStore` is used: same semantics,
//! within this one process. `--features http,metrics` adds `GET /metrics`.

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem::http::IdempotencyLayer;
use idem::{Idempotency, MemoryStore, RedisStore, idempotent};
#[cfg(feature = "metrics")]
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tracing_subscriber::EnvFilter;

/// The body of `POST /payments`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChargeRequest {
    pub order_id: String,
    pub amount_cents: u64,
    pub currency: String,
}

/// What a successful charge returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub receipt_id: String,
    pub order_id: String,
    pub amount_cents: u64,
    pub currency: String,
}

#[derive(Debug)]
pub(crate) enum PaymentError {
    /// The processor refused the card: a final answer (stored and replayed).
    Declined(String),
    /// Idempotency failed (order in flight elsewhere, store down, …).
    Idem(idem::Error),
}

impl From<idem::Error> for PaymentError {
    fn from(e: idem::Error) -> Self {
        PaymentError::Idem(e)
    }
}

/// Stands in for the card processor: counts real charges.
pub(crate) struct Payments {
    idem: Idempotency,
    charges: AtomicU64,
}

impl Payments {
    /// Charges the order's card once per order id, for 24 hours.
    #[idempotent(
        key = req.order_id,
        ttl = "24h",
        scope = "payments.charge.v1",
        fingerprint = (req.amount_cents, req.currency),
        using = self.idem
    )]
    pub async fn charge(&self, req: ChargeRequest) -> Result<Receipt, PaymentError> {
        if req.amount_cents == 0 {
            return Err(PaymentError::Declined("amount must be positive".into()));
        }
        // The processor is slow: duplicates arrive while this runs.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        tracing::info!(order_id = %req.order_id, amount_cents = req.amount_cents, charge = n, "card charged");
        Ok(Receipt {
            receipt_id: format!("rcpt_{n:06}"),
            order_id: req.order_id,
            amount_cents: req.amount_cents,
            currency: req.currency,
        })
    }
}

async fn create_payment(
    State(payments): State<Arc<Payments>>,
    Json(req): Json<ChargeRequest>,
) -> Response {
    match payments.charge(req).await {
        Ok(receipt) => (StatusCode::CREATED, Json(receipt)).into_response(),
        Err(PaymentError::Declined(why)) => {
            (StatusCode::PAYMENT_REQUIRED, Json(json!({ "error": why }))).into_response()
        }
        // Another request (with another Idempotency-Key) is charging this
        // order right now: not stored by the layer, the client retries.
        Err(PaymentError::Idem(idem::Error::InProgress { .. })) => (
            StatusCode::CONFLICT,
            [(header::RETRY_AFTER, HeaderValue::from_static("1"))],
            Json(json!({ "error": "this order is being charged; retry shortly" })),
        )
            .into_response(),
        Err(PaymentError::Idem(idem::Error::FingerprintMismatch)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "error": "this order was charged with another amount or currency" })),
        )
            .into_response(),
        Err(PaymentError::Idem(e)) => {
            tracing::warn!(error = %e, "charge not attempted");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "error": "payments are unavailable; retry later" })),
            )
                .into_response()
        }
    }
}

async fn stats(State(payments): State<Arc<Payments>>) -> Json<serde_json::Value> {
    Json(json!({ "charges": payments.charges.load(Ordering::SeqCst) }))
}

/// The whole API: `POST /payments` behind the idempotency layer, and
/// `GET /stats` (passes through: the layer only handles POST and PATCH).
pub(crate) fn app(idem: Idempotency) -> Router {
    let charges = AtomicU64::new(0);
    let payments = Arc::new(Payments {
        idem: idem.clone(),
        charges,
    });
    Router::new()
        .route("/payments", post(create_payment))
        .route("/stats", get(stats))
        .layer(
            IdempotencyLayer::new(idem)
                .require_key(true)
                .retention(Duration::from_secs(24 * 3600))
                .advertise_retention(true),
        )
        .with_state(payments)
}

/// Adds `GET /metrics`: everything recorded on the `metrics` facade, idem's
/// counters and histograms included, as Prometheus scrapes it.
#[cfg(feature = "metrics")]
pub(crate) fn with_metrics(app: Router, handle: PrometheusHandle) -> Router {
    app.route("/metrics", get(move || std::future::ready(handle.render())))
}

/// Redis from `REDIS_URL`, else the in-process `MemoryStore`.
pub(crate) async fn idempotency_from_env() -> Result<Idempotency, idem::Error> {
    let builder = match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::connect(&url).await?;
            tracing::info!(%url, "idempotency store: Redis");
            Idempotency::builder(store)
        }
        Err(_) => {
            tracing::info!("idempotency store: in-process MemoryStore (REDIS_URL: Redis)");
            Idempotency::builder(MemoryStore::new())
        }
    };
    Ok(builder.namespace("payments-example").build())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let filter = EnvFilter::try_from_default_env();
    let filter = filter.unwrap_or_else(|_| "info,idem_http=debug".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let idem = idempotency_from_env().await?;
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "payments server listening");
    let app = app(idem);
    #[cfg(feature = "metrics")]
    let app = with_metrics(app, PrometheusBuilder::new().install_recorder()?);
    axum::serve(listener, app).await?;
    Ok(())
}
