//! Concurrent duplicates: one execution, every caller the same answer.

use crate::support::{CREATE_PAYMENT, TestServer, payment};
use idem_grpc::IdempotencyLayer;
use idem_testkit::TestContext;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_duplicates_run_once_and_get_one_answer() {
    sixty_four_duplicates(false).await;
}

/// The same with the calls' round trips shared (`share_round_trips`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_duplicates_sharing_round_trips_run_once_and_get_one_answer() {
    sixty_four_duplicates(true).await;
}

async fn sixty_four_duplicates(share_round_trips: bool) {
    let ctx = TestContext::redis().await.with_namespace("grpc-dup");
    let layer = IdempotencyLayer::new(ctx.idem())
        .unary(CREATE_PAYMENT)
        .share_round_trips(share_round_trips)
        .wait(Duration::from_secs(60));
    let server = TestServer::start(layer, ctx.ledger().clone()).await;
    let raw = server.raw();
    let mut message = payment(500);
    // Long enough that the duplicates arrive while the first runs.
    message.sleep_ms = 300;
    let calls: Vec<_> = (0..64)
        .map(|_| {
            let raw = raw.clone();
            let message = message.clone();
            tokio::spawn(async move {
                raw.call(CREATE_PAYMENT, &[("idempotency-key", "dup-1")], &message)
                    .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.unwrap());
    }
    assert_eq!(server.ledger.count("dup-1"), 1, "exactly one execution");
    let first = &answers[0];
    assert_eq!(first.grpc_status().as_deref(), Some("0"));
    assert_eq!(first.payment().run, 1);
    for a in &answers {
        assert_eq!(a.body, first.body, "same message bytes");
        assert_eq!(a.trailers, first.trailers, "same trailers");
        assert_eq!(a.comparable_headers(), first.comparable_headers());
    }
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "one caller ran it, 63 got it replayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_wait_a_duplicate_in_flight_is_aborted_with_a_retry_hint() {
    let ctx = TestContext::redis().await.with_namespace("grpc-busy");
    let layer = IdempotencyLayer::new(ctx.idem())
        .unary(CREATE_PAYMENT)
        .retry_after(Duration::from_millis(250));
    let server = TestServer::start(layer, ctx.ledger().clone()).await;
    let mut slow = payment(500);
    slow.sleep_ms = 2_000;
    let raw = server.raw();
    let first = {
        let raw = raw.clone();
        let slow = slow.clone();
        tokio::spawn(async move {
            raw.call(CREATE_PAYMENT, &[("idempotency-key", "busy")], &slow)
                .await
        })
    };
    idem_testkit::eventually("the first call runs", Duration::from_secs(30), || async {
        (server.ledger.count("busy") == 1).then_some(())
    })
    .await;
    let dup = raw
        .call(CREATE_PAYMENT, &[("idempotency-key", "busy")], &slow)
        .await;
    assert_eq!(dup.grpc_status().as_deref(), Some("10"), "ABORTED: {dup:?}");
    assert_eq!(dup.headers["idem-error"], "key-in-use");
    assert_eq!(dup.headers["grpc-retry-pushback-ms"], "250");
    let first = first.await.unwrap();
    assert_eq!(first.grpc_status().as_deref(), Some("0"));
    let again = raw
        .call(CREATE_PAYMENT, &[("idempotency-key", "busy")], &slow)
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(server.ledger.count("busy"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_duplicates_run_once_and_every_key_replays() {
    cluster_duplicates(false).await;
}

/// The same with the calls' round trips shared: a batch's keys span every
/// master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_sharing_round_trips_duplicates_run_once_and_every_key_replays() {
    cluster_duplicates(true).await;
}

async fn cluster_duplicates(share_round_trips: bool) {
    let ctx = TestContext::redis_cluster()
        .await
        .with_namespace("grpc-cluster");
    let layer = IdempotencyLayer::new(ctx.idem())
        .unary(CREATE_PAYMENT)
        .share_round_trips(share_round_trips)
        .wait(Duration::from_secs(60));
    let server = TestServer::start(layer, ctx.ledger().clone()).await;
    let raw = server.raw();
    let mut message = payment(500);
    message.sleep_ms = 200;
    // Keys over every master's slots, each sent 8 times at once.
    let keys: Vec<String> = (0..12).map(|i| format!("cluster-{i}")).collect();
    let mut calls = Vec::new();
    for key in &keys {
        for _ in 0..8 {
            let (raw, message, key) = (raw.clone(), message.clone(), key.clone());
            calls.push(tokio::spawn(async move {
                let a = raw
                    .call(CREATE_PAYMENT, &[("idempotency-key", &key)], &message)
                    .await;
                (key, a)
            }));
        }
    }
    let mut first: std::collections::HashMap<String, bytes::Bytes> = Default::default();
    for c in calls {
        let (key, a) = c.await.unwrap();
        assert_eq!(a.grpc_status().as_deref(), Some("0"), "{key}: {a:?}");
        let body = first.entry(key.clone()).or_insert_with(|| a.body.clone());
        assert_eq!(*body, a.body, "{key}: one answer");
    }
    for key in &keys {
        assert_eq!(server.ledger.count(key), 1, "{key} ran once");
    }
    assert_eq!(server.ledger.total(), keys.len());
}
