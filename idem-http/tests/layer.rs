//! The layer over real sockets (axum on 127.0.0.1:0, reqwest) and a real
//! Redis (idem-testkit), status by status, with exact handler counts.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idem_core::{Idempotency, RedisStore, RedisStoreConfig};
use idem_http::{IdempotencyKey, IdempotencyLayer};
use idem_testkit::RedisServer;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

const PROBLEM_BASE: &str = "https://errors.example.com/idempotency/";

// ---------------------------------------------------------------- harness

#[derive(Clone, Default)]
struct Counters {
    /// Handler runs (every handler increments it first).
    runs: Arc<AtomicUsize>,
    /// Slow handlers that finished.
    done: Arc<AtomicUsize>,
    /// Slow handlers whose future was dropped before finishing.
    cancelled: Arc<AtomicUsize>,
    panicked: Arc<AtomicBool>,
}

impl Counters {
    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }
}

async fn pay(State(c): State<Counters>, body: Bytes) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let mut r = (
        StatusCode::CREATED,
        format!(r#"{{"payment":{n},"request_bytes":{}}}"#, body.len()),
    )
        .into_response();
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert("x-payment-id", HeaderValue::from(n));
    h.insert("x-custom", HeaderValue::from_static("original"));
    h.append("x-multi", HeaderValue::from_static("one"));
    h.append("x-multi", HeaderValue::from_static("two"));
    h.insert(
        "set-cookie",
        HeaderValue::from_static("session=abc; HttpOnly"),
    );
    r
}

async fn binary(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    let bytes: Vec<u8> = (0..=255u8).rev().chain(0..=255u8).collect();
    ([("content-type", "application/octet-stream")], bytes).into_response()
}

struct CancelGuard(Option<Arc<AtomicUsize>>);
impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.fetch_add(1, SeqCst);
        }
    }
}

/// Sleeps for `x-sleep-ms` (default 1000; a header, so outside the fingerprint).
async fn slow(State(c): State<Counters>, headers: HeaderMap) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let ms = headers
        .get("x-sleep-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let mut guard = CancelGuard(Some(c.cancelled.clone()));
    tokio::time::sleep(Duration::from_millis(ms)).await;
    guard.0 = None;
    c.done.fetch_add(1, SeqCst);
    (StatusCode::OK, format!("slow run {n}")).into_response()
}

async fn status(State(c): State<Counters>, Path(code): Path<u16>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT);
    (
        status,
        [("x-run", n.to_string())],
        format!("status {code} run {n}"),
    )
        .into_response()
}

async fn panic_once(State(c): State<Counters>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    if !c.panicked.swap(true, SeqCst) {
        panic!("handler panics on its first run (test)");
    }
    (StatusCode::CREATED, format!("ok run {n}")).into_response()
}

const BIG: usize = 2 * 1024 * 1024;

async fn big(State(c): State<Counters>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let mut body = vec![b'x'; BIG];
    body[0] = b'0' + (n % 10) as u8;
    body.into_response()
}

/// 3 × 600 000 bytes with no Content-Length: over 1 MiB only mid-stream.
async fn big_stream(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    let chunks = (0..3u8).map(|i| Ok::<_, std::io::Error>(Bytes::from(vec![b'a' + i; 600_000])));
    Body::from_stream(futures_util::stream::iter(chunks)).into_response()
}

async fn key_echo(State(c): State<Counters>, Extension(key): Extension<IdempotencyKey>) -> String {
    c.runs.fetch_add(1, SeqCst);
    format!("key={key}")
}

fn routes(c: &Counters) -> Router {
    Router::new()
        .route("/pay", post(pay).get(pay).put(pay).patch(pay))
        .route("/pay2", post(pay))
        .route("/binary", post(binary))
        .route("/slow", post(slow))
        .route("/status/{code}", post(status))
        .route("/panic-once", post(panic_once))
        .route("/big", post(big))
        .route("/big-stream", post(big_stream))
        .route("/key", post(key_echo))
        .with_state(c.clone())
}

struct Harness {
    url: String,
    counters: Counters,
    http: reqwest::Client,
    redis: RedisServer,
}

impl Harness {
    /// Redis, a runtime over it, and the routes behind `configure(layer)`.
    async fn start(configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> Harness {
        let redis = RedisServer::start();
        let idem = idem_over(&redis).await;
        let counters = Counters::default();
        let app = routes(&counters).layer(configure(
            IdempotencyLayer::new(idem).problem_type_base(PROBLEM_BASE),
        ));
        Harness {
            url: serve(app).await,
            counters,
            http: reqwest::Client::new(),
            redis,
        }
    }

    fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("idempotency-key", key)
            .body(r#"{"amount":500}"#)
    }

    fn runs(&self) -> usize {
        self.counters.runs()
    }
}

async fn idem_over(redis: &RedisServer) -> Idempotency {
    let config = RedisStoreConfig::default()
        .connection_timeout(Duration::from_millis(300))
        .response_timeout(Duration::from_millis(300))
        .reconnect_retries(1);
    let store = RedisStore::connect_with(&redis.url(), config)
        .await
        .expect("connect to the test Redis");
    Idempotency::builder(store)
        .namespace("http-test")
        .store_retries(1)
        .build()
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// Asserts an RFC 9457 problem of the given status and type slug.
    fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status.as_u16(), status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let p = self.json();
        assert_eq!(p["type"], format!("{PROBLEM_BASE}{slug}"));
        assert_eq!(p["status"], status);
        assert!(p["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(p["detail"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(!self.replayed());
    }
}

async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("request sent");
    Answer {
        status: response.status(),
        headers: response.headers().clone(),
        body: response.bytes().await.expect("response body"),
    }
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ------------------------------------------------------------------ tests

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
async fn quoted_and_bare_keys_are_the_same_key() {
    let h = Harness::start(|l| l).await;
    let first = send(h.post("/pay", "abc-1")).await;
    let quoted = send(h.post("/pay", "\"abc-1\"")).await;
    assert!(!first.replayed());
    assert!(quoted.replayed());
    assert_eq!(quoted.body, first.body);

    let first = send(h.post("/pay", r#""a\"b\\c""#)).await;
    let bare = send(h.post("/pay", r#"a"b\c"#)).await;
    assert!(!first.replayed());
    assert!(bare.replayed());
    assert_eq!(bare.body, first.body);
    assert_eq!(h.runs(), 2);

    // The handler sees the unquoted key.
    let echo = send(h.post("/key", "\"with space\"")).await;
    assert_eq!(&echo.body[..], b"key=with space");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_400() {
    let h = Harness::start(|l| l).await;
    let long = "k".repeat(256);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static("\"\""),
        HeaderValue::from_str(&long).unwrap(),
        HeaderValue::from_static(r#""a\nb""#),
        HeaderValue::from_static("\"unterminated"),
        HeaderValue::from_static("\"a\";param=1"),
        HeaderValue::from_static("two words"),
        HeaderValue::from_bytes(b"cl\xc3\xa9").unwrap(),
        HeaderValue::from_bytes(b"a\tb").unwrap(),
    ];
    for value in bad {
        let a = send(
            h.http
                .post(format!("{}/pay", h.url))
                .header("idempotency-key", value.clone())
                .body("{}"),
        )
        .await;
        a.assert_problem(400, "invalid-key");
    }
    // The header twice.
    let a = send(
        h.http
            .post(format!("{}/pay", h.url))
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .body("{}"),
    )
    .await;
    a.assert_problem(400, "invalid-key");
    // 255 bytes is fine.
    let ok = send(h.post("/pay", &"k".repeat(255))).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_is_400_when_required_and_passes_through_otherwise() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let app = Router::new()
        .route(
            "/required",
            post(pay).layer(
                IdempotencyLayer::new(idem.clone())
                    .require_key(true)
                    .problem_type_base(PROBLEM_BASE),
            ),
        )
        .route("/optional", post(pay).layer(IdempotencyLayer::new(idem)))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();

    let a = send(http.post(format!("{url}/required")).body("{}")).await;
    a.assert_problem(400, "missing-key");
    assert_eq!(c.runs(), 0);

    for n in 1..=2 {
        let a = send(http.post(format!("{url}/optional")).body("{}")).await;
        assert_eq!(a.status, StatusCode::CREATED);
        assert!(!a.replayed());
        assert_eq!(a.header("x-payment-id"), Some(n.to_string().as_str()));
    }
    assert_eq!(c.runs(), 2);

    // With a key, the required route is idempotent.
    for _ in 0..2 {
        let a = send(
            http.post(format!("{url}/required"))
                .header("idempotency-key", "r")
                .body("{}"),
        )
        .await;
        assert_eq!(a.status, StatusCode::CREATED);
    }
    assert_eq!(c.runs(), 3);
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
async fn reuse_with_another_request_is_422() {
    let h = Harness::start(|l| l).await;
    let first = send(h.post("/pay", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let other_body = send(h.post("/pay", "k").body(r#"{"amount":501}"#)).await;
    other_body.assert_problem(422, "key-reused");
    let other_path = send(h.post("/pay2", "k")).await;
    other_path.assert_problem(422, "key-reused");
    let other_query = send(h.post("/pay?currency=EUR", "k")).await;
    other_query.assert_problem(422, "key-reused");
    let other_method = send(
        h.http
            .patch(format!("{}/pay", h.url))
            .header("idempotency-key", "k")
            .body(r#"{"amount":500}"#),
    )
    .await;
    other_method.assert_problem(422, "key-reused");

    // While in flight too.
    let slow = tokio::spawn(send(h.post("/slow", "k2").header("x-sleep-ms", "800")));
    wait_until("the slow request runs", || h.runs() == 2).await;
    let mismatch = send(h.post("/slow", "k2").body("other")).await;
    mismatch.assert_problem(422, "key-reused");
    slow.await.expect("slow request");

    assert!(send(h.post("/pay", "k")).await.replayed());
    assert_eq!(h.runs(), 2);
}

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
    for code in [500u16, 502, 503, 408, 409, 425, 429] {
        let key = format!("transient-{code}");
        for run in 1..=2 {
            let a = send(h.post(&format!("/status/{code}"), &key)).await;
            expected += 1;
            assert_eq!(a.status.as_u16(), code);
            assert!(!a.replayed(), "{code} must never be replayed");
            assert_eq!(
                a.body,
                format!("status {code} run {expected}").as_bytes(),
                "{code} run {run}"
            );
        }
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

    let b = send(h.post("/panic-once", "p")).await;
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed());
    assert_eq!(&b.body[..], b"ok run 2");
    let c = send(h.post("/panic-once", "p")).await;
    assert!(c.replayed());
    assert_eq!(c.body, b.body);
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_connection_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let aborted = h
        .post("/slow", "drop-1")
        .header("x-sleep-ms", "5000")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(aborted.is_err_and(|e| e.is_timeout()));
    wait_until("the server drops the handler", || {
        h.counters.cancelled.load(SeqCst) == 1
    })
    .await;

    // The key is free at once (not after the 30 s lease): the handler runs again.
    let end = Instant::now() + Duration::from_secs(2);
    let retry = loop {
        let a = send(h.post("/slow", "drop-1").header("x-sleep-ms", "10")).await;
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
async fn oversized_responses_pass_through_and_are_not_cached() {
    let h = Harness::start(|l| l).await;
    for run in 1..=2u8 {
        let a = send(h.post("/big", "big-1")).await;
        assert_eq!(a.status, StatusCode::OK);
        assert!(!a.replayed());
        assert_eq!(a.body.len(), BIG);
        assert_eq!(a.body[0], b'0' + run);
    }
    // Over the limit only mid-stream: every byte still arrives, in order.
    for _ in 0..2 {
        let a = send(h.post("/big-stream", "big-2")).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body.len(), 1_800_000);
        assert_eq!(
            (a.body[0], a.body[600_000], a.body[1_799_999]),
            (b'a', b'b', b'c')
        );
    }
    assert_eq!(h.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_limit_is_configurable() {
    let h = Harness::start(|l| l.max_response_body(16)).await;
    for n in 1..=2 {
        let a = send(h.post("/pay", "small-limit")).await;
        assert_eq!(a.header("x-payment-id"), Some(n.to_string().as_str()));
        assert!(!a.replayed());
    }
    assert_eq!(h.runs(), 2);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_have_separate_key_spaces() {
    let h = Harness::start(|l| {
        l.tenant(|parts: &axum::http::request::Parts| {
            Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned())
        })
    })
    .await;
    let as_tenant = |t: &str| h.post("/pay", "shared-key").header("x-tenant", t);

    let a = send(as_tenant("acme")).await;
    let b = send(as_tenant("globex")).await;
    let colon = send(as_tenant("acme:x")).await;
    let none = send(h.post("/pay", "shared-key")).await;
    for (answer, id) in [(&a, "1"), (&b, "2"), (&colon, "3"), (&none, "4")] {
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
        assert_eq!(answer.header("x-payment-id"), Some(id));
    }
    let a2 = send(as_tenant("acme")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    let none2 = send(h.post("/pay", "shared-key")).await;
    assert_eq!(none2.body, none.body);
    assert_eq!(h.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_methods_pass_through() {
    let h = Harness::start(|l| l).await;
    for n in 1..=2 {
        let get = send(
            h.http
                .get(format!("{}/pay", h.url))
                .header("idempotency-key", "g"),
        )
        .await;
        assert_eq!(get.header("x-payment-id"), Some(n.to_string().as_str()));
        assert!(!get.replayed());
    }
    for _ in 0..2 {
        let put = send(
            h.http
                .put(format!("{}/pay", h.url))
                .header("idempotency-key", "\""),
        )
        .await;
        assert_eq!(
            put.status,
            StatusCode::CREATED,
            "PUT is not checked, even with a bad key"
        );
    }
    assert_eq!(h.runs(), 4);
    // PATCH is covered by default.
    let patch = || {
        h.http
            .patch(format!("{}/pay", h.url))
            .header("idempotency-key", "p")
            .body("{}")
    };
    send(patch()).await;
    assert!(send(patch()).await.replayed());
    assert_eq!(h.runs(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_are_configurable() {
    let h = Harness::start(|l| l.methods([Method::PUT])).await;
    let put = || {
        h.http
            .put(format!("{}/pay", h.url))
            .header("idempotency-key", "m")
            .body("{}")
    };
    send(put()).await;
    assert!(send(put()).await.replayed());
    assert_eq!(h.runs(), 1);
    send(h.post("/pay", "m")).await;
    assert!(!send(h.post("/pay", "m")).await.replayed());
    assert_eq!(h.runs(), 3);
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

#[tokio::test]
async fn the_key_reaches_the_handler() {
    let idem = Idempotency::builder(idem_core::MemoryStore::new()).build();
    let app = Router::new()
        .route(
            "/",
            post(|Extension(k): Extension<IdempotencyKey>| async move { k.as_str().to_owned() }),
        )
        .route("/get", get(|| async { "get" }))
        .layer(IdempotencyLayer::new(idem));
    let url = serve(app).await;
    let a = send(
        reqwest::Client::new()
            .post(format!("{url}/"))
            .header("idempotency-key", "\"x y\""),
    )
    .await;
    assert_eq!(&a.body[..], b"x y");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_layer_and_a_route_layer_combine() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let app = Router::new()
        .route(
            "/required",
            post(pay).layer(
                IdempotencyLayer::new(idem.clone())
                    .require_key(true)
                    .problem_type_base(PROBLEM_BASE),
            ),
        )
        .route("/optional", post(pay))
        .layer(IdempotencyLayer::new(idem))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();

    send(http.post(format!("{url}/required")).body("{}"))
        .await
        .assert_problem(400, "missing-key");
    let with_key = || {
        http.post(format!("{url}/required"))
            .header("idempotency-key", "both")
            .body("{}")
    };
    let first = send(with_key()).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "not a 409 from the inner layer"
    );
    assert!(send(with_key()).await.replayed());
    let optional = send(http.post(format!("{url}/optional")).body("{}")).await;
    assert_eq!(optional.status, StatusCode::CREATED);
    assert_eq!(c.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_routers_fingerprint_the_full_path() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let versioned = |idem: Idempotency| {
        Router::new()
            .route("/pay", post(pay))
            .layer(IdempotencyLayer::new(idem).problem_type_base(PROBLEM_BASE))
    };
    let app = Router::new()
        .nest("/v1", versioned(idem.clone()))
        .nest("/v2", versioned(idem))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();
    let at = |path: &str| {
        http.post(format!("{url}{path}"))
            .header("idempotency-key", "nested")
            .body("{}")
    };
    assert_eq!(send(at("/v1/pay")).await.status, StatusCode::CREATED);
    send(at("/v2/pay")).await.assert_problem(422, "key-reused");
    assert!(send(at("/v1/pay")).await.replayed());
    assert_eq!(c.runs(), 1);
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
