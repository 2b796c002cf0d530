//! Failures and cancellation: the store down (fail closed), transient
//! statuses, panicking handlers and bodies, and clients that disconnect.

use crate::support::{Harness, send, wait_until};
use axum::http::StatusCode;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_is_503_and_the_handler_does_not_run() {
    let mut h = Harness::start(|l| l).await;
    assert_eq!(
        send(h.post("/pay", "before")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(h.runs(), 1);

    h.redis.kill();
    for key in ["during-1", "during-2", "before"] {
        let a = send(h.post("/pay", key)).await;
        a.assert_problem(503, "store-unavailable");
        assert_eq!(a.header("retry-after"), Some("1"));
    }
    assert_eq!(
        h.runs(),
        1,
        "fail-closed: no handler ran while the store was down"
    );

    // Back up (empty): requests run again once the connection is re-made.
    h.redis.restart();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let a = send(h.post("/pay", "after")).await;
        if a.status == StatusCode::CREATED {
            break;
        }
        a.assert_problem(503, "store-unavailable");
        assert!(Instant::now() < end, "the store did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(h.runs(), 2);
    assert!(send(h.post("/pay", "after")).await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_statuses_release_the_key_and_final_ones_replay() {
    let h = Harness::start(|l| l).await;
    let mut expected = 0;
    // Released (so the client's retry runs the handler), found without a second run.
    for code in [500u16, 502, 503, 401, 403, 408, 409, 425, 429] {
        let key = format!("transient-{code}");
        let a = send(h.post(&format!("/status/{code}"), &key)).await;
        expected += 1;
        assert_eq!(a.status.as_u16(), code);
        assert!(!a.replayed(), "{code} must never be replayed");
        assert_eq!(a.body, format!("status {code} run {expected}").as_bytes());
        assert!(h.key_is_free(&key).await, "{code} releases the key");
    }
    assert_eq!(h.runs(), expected);

    for code in [200u16, 202, 303, 400, 404, 422] {
        let key = format!("final-{code}");
        let first = send(h.post(&format!("/status/{code}"), &key)).await;
        let again = send(h.post(&format!("/status/{code}"), &key)).await;
        expected += 1;
        assert_eq!(again.status.as_u16(), code);
        assert!(again.replayed(), "{code} is stored");
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("x-run"), first.header("x-run"));
    }
    assert_eq!(h.runs(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_a_500_and_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/panic-once", "p")).await;
    a.assert_problem(500, "handler-panicked");
    assert_eq!(h.runs(), 1);
    // Released (so the client's retry runs it), found without running it again.
    assert!(h.key_is_free("p").await);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_response_body_is_a_500_and_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/panic-body", "pb-1")).await;
    a.assert_problem(500, "handler-panicked");
    assert_eq!(h.runs(), 1);
    assert!(h.key_is_free("pb-1").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_response_body_is_a_500_and_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/failing-body", "fb-1")).await;
    a.assert_problem(500, "response-failed");
    assert_eq!(h.runs(), 1);
    assert!(h.key_is_free("fb-1").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_connection_does_not_cancel_the_handler() {
    let h = Harness::start(|l| l).await;
    let aborted = h
        .post("/slow", "drop-1")
        .header("x-sleep-ms", "1000")
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(aborted.is_err_and(|e| e.is_timeout()));

    // The retry while the handler still runs is told to come back later...
    let during = send(h.post("/slow", "drop-1")).await;
    during.assert_problem(409, "key-in-use");
    wait_until("the handler finishes", || h.counters.done.load(SeqCst) == 1).await;
    assert_eq!(h.counters.cancelled.load(SeqCst), 0);

    // ...and then gets the response of the run the client walked away from.
    let end = Instant::now() + Duration::from_secs(5);
    let retry = loop {
        let a = send(h.post("/slow", "drop-1")).await;
        if a.status != StatusCode::CONFLICT || Instant::now() > end {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"slow run 1");
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_disconnect_cancels_the_handler_and_keeps_the_key_for_the_lease() {
    let lease = Duration::from_secs(1);
    let h = Harness::start(|l| l.cancel_on_disconnect(true).lease(lease)).await;
    // Before the claim: the key's lease ends no sooner than a lease later.
    let started = Instant::now();
    let aborted = h
        .post("/slow", "drop-2")
        .header("x-sleep-ms", "5000")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(aborted.is_err_and(|e| e.is_timeout()));
    wait_until("the server drops the handler", || {
        h.counters.cancelled.load(SeqCst) == 1
    })
    .await;
    // The handler may have made effects: its key is not released...
    let during = send(h.post("/slow", "drop-2").header("x-sleep-ms", "0")).await;
    if started.elapsed() < lease {
        during.assert_problem(409, "key-in-use");
    }
    // ...until its lease ends; then the retry runs the handler again.
    let end = Instant::now() + Duration::from_secs(20);
    let retry = loop {
        let a = send(h.post("/slow", "drop-2").header("x-sleep-ms", "0")).await;
        if a.status != StatusCode::CONFLICT || Instant::now() > end {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(retry.status, StatusCode::OK);
    assert!(!retry.replayed());
    assert_eq!(&retry.body[..], b"slow run 2");
    assert_eq!(h.runs(), 2);
    assert_eq!(h.counters.done.load(SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_disconnect_mid_response_stores_processed_not_kept() {
    // Events kept like any response: an endless one, read by the layer
    // until its client leaves.
    let h = Harness::start(|l| {
        l.cancel_on_disconnect(true)
            .stream_content_types(Vec::<String>::new())
    })
    .await;
    let mut events = h.post("/sse", "gone-1").send().await.unwrap();
    assert_eq!(events.status(), StatusCode::OK);
    let first = events.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: run 1 event 0"));
    // The client leaves mid-response; the handler has run all the same.
    drop(events);
    wait_until("the layer stops reading the stream", || {
        h.counters.streams_dropped.load(SeqCst) == 1
    })
    .await;
    let end = Instant::now() + Duration::from_secs(10);
    let dup = loop {
        // A released key would run the endless handler again.
        let d = tokio::time::timeout(Duration::from_secs(10), send(h.post("/sse", "gone-1")))
            .await
            .expect("the key was released: the handler ran again");
        if d.status != StatusCode::CONFLICT || Instant::now() > end {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    dup.assert_problem(410, "response-not-kept");
    assert_eq!(dup.json()["processed_status"], 200);
    assert_eq!(h.runs(), 1);
}
