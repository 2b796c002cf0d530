//! Bodies: streamed responses, Server-Sent Events, responses and requests
//! over the size limits, and compressed responses replayed decoded.

use crate::support::{BIG, Harness, send, wait_until};
use axum::body::Bytes;
use axum::http::StatusCode;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_responses_pass_through_and_are_not_cached() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/big", "big-1")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(!a.replayed());
    assert_eq!(a.body.len(), BIG);
    assert_eq!(a.body[0], b'1');
    // Over the limit only mid-stream: every byte still arrives, in order.
    let a = send(h.post("/big-stream", "big-2")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body.len(), 1_800_000);
    assert_eq!(
        (a.body[0], a.body[600_000], a.body[1_799_999]),
        (b'a', b'b', b'c')
    );
    // Duplicates learn that the request was processed; nothing runs again.
    for key in ["big-1", "big-2"] {
        let path = if key == "big-1" {
            "/big"
        } else {
            "/big-stream"
        };
        for _ in 0..2 {
            let d = send(h.post(path, key)).await;
            d.assert_problem(410, "response-not-kept");
            assert_eq!(d.json()["processed_status"], 200);
            assert!(
                d.json()["detail"]
                    .as_str()
                    .unwrap()
                    .contains("was processed")
            );
        }
    }
    assert_eq!(h.runs(), 2);
}

/// A response within `max_response_body` whose stored record would be over
/// the runtime's value limit (40 KiB of quotes, twice that JSON-escaped,
/// under a 64 KiB limit) reaches the first client whole; retries get 410
/// `response-not-kept`, and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_runtimes_value_limit_is_answered_once_then_not_kept() {
    let h = Harness::start_with_runtime(|b| b.max_value_size(64 * 1024), |l| l).await;
    let a = send(h.post("/quotes/40960", "quotes-1")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body.len(), 40960);
    for _ in 0..2 {
        let d = send(h.post("/quotes/40960", "quotes-1")).await;
        d.assert_problem(410, "response-not-kept");
        assert_eq!(d.json()["processed_status"], 200);
    }
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_limit_is_configurable() {
    let h = Harness::start(|l| l.max_response_body(16)).await;
    let a = send(h.post("/pay", "small-limit")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.header("x-payment-id"), Some("1"));
    let b = send(h.post("/pay", "small-limit")).await;
    b.assert_problem(410, "response-not-kept");
    assert_eq!(b.json()["processed_status"], 201);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_gets_a_typed_error_for_a_response_not_kept() {
    let h = Harness::start(|l| l.max_response_body(16)).await;
    let client = idem_client::Client::builder(&h.url)
        .retry(
            idem_client::RetryPolicy::default()
                .max_retries(3)
                .initial_backoff(Duration::from_millis(10)),
        )
        .build()
        .unwrap();
    let first = client
        .post_with_key::<_, serde_json::Value>("/pay", "nk-1", &serde_json::json!({"a": 1}))
        .await
        .unwrap();
    assert_eq!(first.value["payment"], 1);
    let err = client
        .post_with_key::<_, serde_json::Value>("/pay", "nk-1", &serde_json::json!({"a": 1}))
        .await
        .unwrap_err();
    match err.kind() {
        idem_client::ClientErrorKind::ResponseNotKept {
            processed_status, ..
        } => {
            assert_eq!(*processed_status, Some(StatusCode::CREATED));
            let attempts = err.context().map(|c| c.attempts);
            assert_eq!(attempts, Some(1), "never retried");
        }
        other => panic!("expected ResponseNotKept, got {other:?}"),
    }
    assert!(err.to_string().contains("was processed"), "{err}");
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_within_the_limit_is_streamed_then_stored() {
    let h = Harness::start(|l| l).await;
    let mut first = h.post("/gated", "gated-1").send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // The first half arrives while the handler's body is still open.
    let head = first.chunk().await.unwrap().unwrap();
    assert_eq!(&head[..], b"run 1 part1;");
    let during = send(h.post("/gated", "gated-1")).await;
    during.assert_problem(409, "key-in-use");

    h.counters.gate.0.add_permits(1);
    let mut body = head.to_vec();
    while let Some(chunk) = first.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    assert_eq!(&body[..], b"run 1 part1;part2");
    // Stored before the client saw the end of the body: no 409 now.
    let again = send(h.post("/gated", "gated-1")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(&again.body[..], &body[..]);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_sent_events_stream_and_duplicates_get_not_kept() {
    let h = Harness::start(|l| l).await;
    let mut events = h.post("/sse", "sse-1").send().await.unwrap();
    assert_eq!(events.status(), StatusCode::OK);
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    let mut seen = String::new();
    while !seen.contains("event 2") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), events.chunk())
            .await
            .expect("events arrive while the stream is open")
            .unwrap()
            .unwrap();
        seen.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(seen.starts_with("data: run 1 event 0"), "{seen}");
    // The stream is still open, and the key does not answer 409 for it.
    let dup = send(h.post("/sse", "sse-1")).await;
    dup.assert_problem(410, "response-not-kept");
    assert_eq!(dup.json()["processed_status"], 200);
    drop(events);
    wait_until("the endless stream is dropped with its client", || {
        h.counters.streams_dropped.load(SeqCst) == 1
    })
    .await;
    let dup = send(h.post("/sse", "sse-1")).await;
    dup.assert_problem(410, "response-not-kept");
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_stream_is_marked_not_kept_once_past_the_limit() {
    let h = Harness::start(|l| l.max_response_body(256 * 1024)).await;
    let mut stream = h.post("/endless", "endless-1").send().await.unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    let mut read = first.len();
    while read <= 512 * 1024 {
        read += stream.chunk().await.unwrap().unwrap().len();
    }
    // Past the limit the marker is stored while the stream goes on.
    let end = Instant::now() + Duration::from_secs(5);
    let dup = loop {
        let d = send(h.post("/endless", "endless-1")).await;
        if d.status != StatusCode::CONFLICT || Instant::now() > end {
            break d;
        }
        read += stream.chunk().await.unwrap().unwrap().len();
    };
    dup.assert_problem(410, "response-not-kept");
    read += stream.chunk().await.unwrap().unwrap().len();
    assert!(read > 512 * 1024);
    drop(stream);
    wait_until("the endless stream is dropped with its client", || {
        h.counters.streams_dropped.load(SeqCst) == 1
    })
    .await;
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_content_types_and_bypass_are_configurable() {
    // Event streams kept like any response (and cut at the limit)...
    let h = Harness::start(|l| {
        l.stream_content_types(Vec::<String>::new())
            .max_response_body(4096)
            .bypass(|parts: &axum::http::request::Parts| parts.uri.path() == "/claimed")
    })
    .await;
    let mut events = h.post("/sse", "sse-2").send().await.unwrap();
    let chunk = events.chunk().await.unwrap().unwrap();
    assert!(chunk.starts_with(b"data: run 1 event 0"));
    let dup = send(h.post("/sse", "sse-2")).await;
    dup.assert_problem(409, "key-in-use"); // buffered up to the limit, not yet past it
    drop(events);
    // ...and a bypassed route is never claimed.
    let a = send(h.post("/claimed", "bypassed")).await;
    assert_eq!(&a.body[..], b"claimed=false");
    assert!(h.key_is_free("bypassed").await);
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_response_is_replayed_decoded_to_a_client_without_gzip() {
    let h = Harness::start(|l| l).await;
    let gz = send(
        h.post("/compressed", "gz-1")
            .header("accept-encoding", "gzip"),
    )
    .await;
    assert_eq!(gz.status, StatusCode::CREATED);
    assert_eq!(gz.header("content-encoding"), Some("gzip"));
    assert_eq!(&gz.body[..2], &[0x1f, 0x8b]);

    let plain = send(h.post("/compressed", "gz-1")).await;
    assert_eq!(plain.status, StatusCode::CREATED);
    assert!(plain.replayed());
    assert_eq!(plain.header("content-encoding"), None);
    assert_eq!(plain.json()["run"], 1);
    assert_eq!(
        plain.header("content-length"),
        Some(plain.body.len().to_string().as_str())
    );

    let identity = send(
        h.post("/compressed", "gz-1")
            .header("accept-encoding", "gzip;q=0, identity"),
    )
    .await;
    assert_eq!(identity.body, plain.body);

    let gz_again = send(
        h.post("/compressed", "gz-1")
            .header("accept-encoding", "gzip"),
    )
    .await;
    assert!(gz_again.replayed());
    assert_eq!(gz_again.header("content-encoding"), Some("gzip"));
    assert_eq!(gz_again.body, gz.body);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_413() {
    let h = Harness::start(|l| l.max_request_body(1024)).await;
    let a = send(h.post("/pay", "req-big").body(vec![b'x'; 2048])).await;
    a.assert_problem(413, "request-too-large");
    // Without Content-Length (chunked), found while reading.
    let chunks: Vec<_> = (0..4)
        .map(|_| Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(vec![b'y'; 512]))))
        .collect();
    let stream = reqwest::Body::wrap(http_body_util::StreamBody::new(futures_util::stream::iter(
        chunks,
    )));
    let a = send(h.post("/pay", "req-big").body(stream)).await;
    a.assert_problem(413, "request-too-large");
    assert_eq!(h.runs(), 0);
    let ok = send(h.post("/pay", "req-big").body(vec![b'x'; 1024])).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}
