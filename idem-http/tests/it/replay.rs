//! What a duplicate gets: the stored response byte for byte, a 409 with
//! Retry-After while the first still runs (or the replay, with a wait), and
//! one handler run among concurrent duplicates.

use crate::support::{Harness, send, wait_until};
use axum::http::StatusCode;
use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_byte_for_byte_with_original_headers() {
    let h = Harness::start(|l| l).await;

    let first = send(h.post("/pay", "order-1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.header("x-payment-id"), Some("1"));
    assert_eq!(first.header("set-cookie"), Some("session=abc; HttpOnly"));

    let again = send(h.post("/pay", "order-1")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("x-payment-id"), Some("1"));
    assert_eq!(again.header("x-custom"), Some("original"));
    assert_eq!(again.header("content-type"), Some("application/json"));
    let multi: Vec<_> = again.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["one", "two"]);
    assert!(
        again.headers.get("set-cookie").is_none(),
        "Set-Cookie is not replayed by default"
    );
    assert!(again.headers.get("idempotency-retention").is_none());
    assert_eq!(h.runs(), 1);

    // Non-UTF-8 bodies replay exactly too.
    let first = send(h.post("/binary", "bin-1")).await;
    let again = send(h.post("/binary", "bin-1")).await;
    assert_eq!(first.body.len(), 512);
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
    assert_eq!(
        again.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_is_advertised_and_set_cookie_replay_is_opt_in() {
    let h = Harness::start(|l| {
        l.retention(Duration::from_secs(3600))
            .advertise_retention(true)
            .replay_set_cookie(true)
    })
    .await;
    let first = send(h.post("/pay", "r")).await;
    let again = send(h.post("/pay", "r")).await;
    assert_eq!(first.header("idempotency-retention"), Some("3600"));
    assert_eq!(again.header("idempotency-retention"), Some("3600"));
    assert!(again.replayed());
    assert_eq!(again.header("set-cookie"), Some("session=abc; HttpOnly"));
    // Errors do not advertise it.
    let mismatch = send(h.post("/pay", "r").body("x")).await;
    assert!(mismatch.headers.get("idempotency-retention").is_none());
    // The record really expires after the retention.
    let ttl = h.redis.cli(&["PTTL", "http-test:http:r"]);
    let ttl: i64 = ttl.parse().expect("PTTL answers a number");
    assert!(ttl > 3_500_000 && ttl <= 3_600_000, "PTTL {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_duplicate_is_409_with_retry_after() {
    let h = Harness::start(|l| l).await;
    let first = tokio::spawn(send(h.post("/slow", "slow-1").header("x-sleep-ms", "1500")));
    wait_until("the first request runs", || h.runs() == 1).await;

    let dup = send(h.post("/slow", "slow-1")).await;
    dup.assert_problem(409, "key-in-use");
    assert_eq!(dup.header("retry-after"), Some("1"));

    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed());
    let after = send(h.post("/slow", "slow-1")).await;
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_configurable() {
    let h = Harness::start(|l| l.retry_after(Duration::from_millis(2500))).await;
    let first = tokio::spawn(send(h.post("/slow", "s").header("x-sleep-ms", "800")));
    wait_until("the first request runs", || h.runs() == 1).await;
    let dup = send(h.post("/slow", "s")).await;
    dup.assert_problem(409, "key-in-use");
    assert_eq!(dup.header("retry-after"), Some("3"));
    first.await.expect("first request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_duration_max_saturates() {
    let h = Harness::start(|l| l.retry_after(Duration::MAX)).await;
    let first = tokio::spawn(send(h.post("/slow", "max").header("x-sleep-ms", "500")));
    wait_until("the first request runs", || h.runs() == 1).await;
    let dup = send(h.post("/slow", "max")).await;
    dup.assert_problem(409, "key-in-use");
    assert_eq!(
        dup.header("retry-after"),
        Some(u64::MAX.to_string().as_str())
    );
    first.await.expect("first request");
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_the_handler_once() {
    let h = Arc::new(Harness::start(|l| l).await);
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (h, barrier) = (h.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(h.post("/slow", "same-key").header("x-sleep-ms", "300")).await
            })
        })
        .collect();
    let mut executed = 0;
    let mut replayed = 0;
    let mut conflicts = 0;
    let mut bodies = Vec::new();
    for t in tasks {
        let a = t.await.expect("task");
        match a.status {
            StatusCode::OK if a.replayed() => {
                replayed += 1;
                bodies.push(a.body);
            }
            StatusCode::OK => {
                executed += 1;
                bodies.push(a.body);
            }
            StatusCode::CONFLICT => {
                a.assert_problem(409, "key-in-use");
                conflicts += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(executed + replayed + conflicts, 16);
    assert!(bodies.iter().all(|b| &b[..] == b"slow run 1"));
    assert_eq!(h.runs(), 1);
    assert_eq!(h.counters.done.load(SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_a_duplicate_gets_the_replay_instead_of_409() {
    let h = Harness::start(|l| l.wait(Duration::from_secs(5))).await;
    let first = tokio::spawn(send(h.post("/slow", "w").header("x-sleep-ms", "500")));
    wait_until("the first request runs", || h.runs() == 1).await;
    let dup = send(h.post("/slow", "w")).await;
    assert_eq!(dup.status, StatusCode::OK);
    assert!(dup.replayed());
    let first = first.await.expect("first request");
    assert!(!first.replayed());
    assert_eq!(dup.body, first.body);
    assert_eq!(h.runs(), 1);
}
