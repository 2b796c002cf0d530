//! The payments example's `/metrics`, scraped over a real socket after a
//! known sequence of requests: exact counts per outcome.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

#[path = "../examples/payments_server.rs"]
#[allow(dead_code)]
mod server;

use idem::{Idempotency, MemoryStore};
use std::collections::BTreeMap;

/// `idem_calls_total` summed per outcome label.
fn calls_by_outcome(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("idem_calls_total{")) {
        let outcome = line
            .split("outcome=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap()
            .to_owned();
        let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        *out.entry(outcome).or_default() += n;
    }
    out
}

#[tokio::test]
async fn payments_server_serves_exact_counts() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("payments-example")
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(listener, server::with_metrics(server::app(idem), handle))
            .await
            .unwrap()
    });
    let http = reqwest::Client::new();
    let body = serde_json::json!({"order_id": "order-1", "amount_cents": 1999, "currency": "EUR"});
    let post = |key: &'static str| {
        http.post(format!("{base}/payments"))
            .header("idempotency-key", key)
            .json(&body)
            .send()
    };
    // Key A runs the layer and the charge; its retry is replayed by the
    // layer; key B for the same order runs the layer, and the charge (keyed
    // by order) replays.
    for key in ["key-a", "key-a", "key-b"] {
        assert_eq!(post(key).await.unwrap().status(), 201);
    }
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let calls = calls_by_outcome(&text);
    assert_eq!(
        calls,
        BTreeMap::from([("executed".to_owned(), 3), ("replayed".to_owned(), 2)]),
        "{text}"
    );
    assert!(text.contains("namespace=\"payments-example\""), "{text}");
    assert!(text.contains("idem_store_seconds"), "{text}");
    assert!(text.contains("idem_body_seconds"), "{text}");
    assert!(text.contains("idem_bodies_in_flight 0"), "{text}");
    assert!(
        !text.contains("key-a") && !text.contains("order-1"),
        "keys never become labels"
    );
}
