//! The layer over real sockets (axum on 127.0.0.1:0, reqwest) and a real
//! Redis (idem-testkit), status by status, with exact handler counts.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idem_core::{Idempotency, Outcome, RedisStore, RedisStoreConfig};
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
    /// Streaming bodies dropped (the client went away, or they ended).
    streams_dropped: Arc<AtomicUsize>,
    /// Permits let `/gated` send the second half of its body.
    gate: Gate,
}

#[derive(Clone)]
struct Gate(Arc<tokio::sync::Semaphore>);

impl Default for Gate {
    fn default() -> Self {
        Gate(Arc::new(tokio::sync::Semaphore::new(0)))
    }
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

/// Server-Sent Events, one every 20 ms, forever.
async fn sse(
    State(c): State<Counters>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, std::convert::Infallible>>> {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let guard = CancelGuard(Some(c.streams_dropped.clone()));
    let events = futures_util::stream::unfold((0u64, guard), move |(i, guard)| async move {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let event = Event::default().data(format!("run {n} event {i}"));
        Some((Ok(event), (i + 1, guard)))
    });
    Sse::new(events)
}

/// 64 KiB chunks of octets, forever, no Content-Length.
async fn endless(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    let guard = CancelGuard(Some(c.streams_dropped.clone()));
    let chunks = futures_util::stream::unfold(guard, |guard| async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        Some((
            Ok::<_, std::io::Error>(Bytes::from(vec![b'e'; 64 * 1024])),
            guard,
        ))
    });
    (
        [("content-type", "application/octet-stream")],
        Body::from_stream(chunks),
    )
        .into_response()
}

/// `part1;`, then, once the test adds a permit to the gate, `part2`.
async fn gated(State(c): State<Counters>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let gate = c.gate.0.clone();
    let parts = futures_util::stream::unfold(0u8, move |i| {
        let gate = gate.clone();
        async move {
            match i {
                0 => Some((
                    Ok::<_, std::io::Error>(Bytes::from(format!("run {n} part1;"))),
                    1,
                )),
                1 => {
                    gate.acquire().await.expect("gate open").forget();
                    Some((Ok(Bytes::from_static(b"part2")), 2))
                }
                _ => None,
            }
        }
    });
    (StatusCode::CREATED, Body::from_stream(parts)).into_response()
}

/// A body whose stream panics on its first poll (after the handler returned).
async fn panic_body(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    let chunks = futures_util::stream::poll_fn(
        |_| -> std::task::Poll<Option<Result<Bytes, std::io::Error>>> {
            panic!("the response body panics (test)")
        },
    );
    Body::from_stream(chunks).into_response()
}

/// A body whose stream fails on its first poll.
async fn failing_body(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    let chunks = futures_util::stream::iter([Err::<Bytes, _>(std::io::Error::other(
        "the database went away (test)",
    ))]);
    Body::from_stream(chunks).into_response()
}

/// 401 unless `Authorization: Bearer good`.
async fn guarded(State(c): State<Counters>, headers: HeaderMap) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    match headers.get("authorization").and_then(|v| v.to_str().ok()) {
        Some("Bearer good") => (StatusCode::CREATED, format!("created by run {n}")).into_response(),
        Some(_) => (StatusCode::FORBIDDEN, format!("forbidden run {n}")).into_response(),
        None => (StatusCode::UNAUTHORIZED, format!("unauthorized run {n}")).into_response(),
    }
}

/// A JSON document large enough for tower-http to compress it.
async fn compressible(State(c): State<Counters>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let doc = serde_json::json!({ "run": n, "padding": "abc".repeat(200) });
    (StatusCode::CREATED, axum::Json(doc)).into_response()
}

/// Whether the layer handled the request (it puts the key in the extensions).
async fn claimed(State(c): State<Counters>, request: axum::extract::Request) -> String {
    c.runs.fetch_add(1, SeqCst);
    format!(
        "claimed={}",
        request.extensions().get::<IdempotencyKey>().is_some()
    )
}

async fn key_json(
    State(c): State<Counters>,
    Extension(key): Extension<IdempotencyKey>,
) -> axum::Json<serde_json::Value> {
    c.runs.fetch_add(1, SeqCst);
    axum::Json(serde_json::json!({ "key": key.as_str() }))
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
        .route("/key-json", post(key_json))
        .route("/sse", post(sse))
        .route("/endless", post(endless))
        .route("/gated", post(gated))
        .route("/panic-body", post(panic_body))
        .route("/failing-body", post(failing_body))
        .route("/guarded", post(guarded))
        .route("/claimed", post(claimed))
        .route(
            "/compressed",
            post(compressible).layer(tower_http::compression::CompressionLayer::new()),
        )
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

    /// Whether `key` (of the tenant-less key space) is free, found without
    /// running any handler: a direct call claims it, runs nothing of the
    /// app's, and says whether it executed. Waits out a claim still being
    /// released.
    async fn key_is_free(&self, key: &str) -> bool {
        let idem = idem_over(&self.redis).await;
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let r = idem
                .call(idem_http::DEFAULT_SCOPE, key)
                .run_outcome(|| async { Ok::<_, idem_core::Error>(()) })
                .await;
            match r {
                Err(idem_core::Error::InProgress { .. }) if Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok((_, outcome)) => return outcome == Outcome::Executed,
                Err(_) => return false,
            }
        }
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
    match &err {
        idem_client::ClientError::ResponseNotKept {
            processed_status,
            attempts,
            ..
        } => {
            assert_eq!(*processed_status, Some(StatusCode::CREATED));
            assert_eq!(*attempts, 1, "never retried");
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
async fn a_panic_in_the_response_body_is_a_500_and_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/panic-body", "pb-1")).await;
    a.assert_problem(500, "handler-panicked");
    assert_eq!(h.runs(), 1);
    assert!(h.key_is_free("pb-1").await);
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
async fn keys_are_isolated_per_credential_by_default() {
    let h = Harness::start(|l| l).await;
    let as_ = |who: &str, key: &str, body: &'static str| {
        h.post("/pay", key)
            .header("authorization", format!("Bearer {who}"))
            .body(body)
    };
    // B uses the key first, with its own body: A's request is not a 422.
    let b_other = send(as_("b", "shared", r#"{"amount":1}"#)).await;
    let a = send(as_("a", "shared", r#"{"amount":500}"#)).await;
    assert_eq!(b_other.status, StatusCode::CREATED);
    assert_eq!(a.status, StatusCode::CREATED);
    assert!(!a.replayed());
    // A's key and body from B never replay A's response (and its Location-like headers).
    let a2 = send(as_("a", "k2", r#"{"amount":7}"#)).await;
    let b2 = send(as_("b", "k2", r#"{"amount":7}"#)).await;
    assert!(!b2.replayed());
    assert_ne!(b2.header("x-payment-id"), a2.header("x-payment-id"));
    // Each principal's retries replay its own responses.
    for (who, key, body, first) in [
        ("a", "shared", r#"{"amount":500}"#, &a),
        ("b", "shared", r#"{"amount":1}"#, &b_other),
        ("a", "k2", r#"{"amount":7}"#, &a2),
        ("b", "k2", r#"{"amount":7}"#, &b2),
    ] {
        let again = send(as_(who, key, body)).await;
        assert!(again.replayed(), "{who} {key}");
        assert_eq!(again.body, first.body, "{who} {key}");
        assert_eq!(again.header("x-payment-id"), first.header("x-payment-id"));
    }
    assert_eq!(h.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_keys_are_an_explicit_opt_in() {
    let h = Harness::start(|l| l.shared_keys()).await;
    let a = send(h.post("/pay", "s").header("authorization", "Bearer a")).await;
    let b = send(h.post("/pay", "s").header("authorization", "Bearer b")).await;
    assert!(b.replayed());
    assert_eq!(b.body, a.body);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_refusals_are_never_stored() {
    // One key space for all, so that a fixed request would meet the refused one's key.
    let h = Harness::start(|l| l.shared_keys()).await;
    let refused = send(h.post("/guarded", "g-401")).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let forbidden = send(
        h.post("/guarded", "g-403")
            .header("authorization", "Bearer bad"),
    )
    .await;
    assert_eq!(forbidden.status, StatusCode::FORBIDDEN);
    // Neither refusal was stored: the client that fixes its credentials gets a fresh answer.
    assert!(h.key_is_free("g-401").await);
    assert!(h.key_is_free("g-403").await);
    let ok = send(
        h.post("/guarded", "g-ok")
            .header("authorization", "Bearer good"),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let again = send(
        h.post("/guarded", "g-ok")
            .header("authorization", "Bearer good"),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, ok.body);
    assert_eq!(h.runs(), 3);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_never_sends_a_key_the_server_refuses() {
    let h = Harness::start(|l| l).await;
    let client = idem_client::Client::builder(&h.url)
        .retry(idem_client::RetryPolicy::no_retries())
        .build()
        .unwrap();
    let mut keys: Vec<String> = [
        "a",
        "a b",
        " a ",
        " a",
        "a ",
        "\"",
        "\"abc",
        "abc\"",
        "a\"b",
        "a\\b",
        "\\",
        "\"\"",
        "~!#$%&'()*+,-./:;<=>?@[]^_`{|}",
        "a;b=1",
        "",
        " ",
        "   ",
        "\t",
        "a\tb",
        "a\nb",
        "\u{7f}",
        "caf\u{e9}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    keys.push("k".repeat(255));
    keys.push("k".repeat(256));
    keys.push(" ".repeat(254) + "x");
    for b in 0x20u8..=0x7e {
        keys.push(format!("x{}y", char::from(b)));
    }
    let mut sent = 0;
    for key in &keys {
        let answer = client
            .post_with_key::<_, serde_json::Value>("/key-json", key, &serde_json::json!({}))
            .await;
        match answer {
            Ok(r) => {
                sent += 1;
                assert_eq!(r.value["key"], key.as_str(), "the server read {key:?} back");
            }
            Err(idem_client::ClientError::InvalidKey { .. }) => {
                // Refused by the client: the server refuses every form of it as well.
                for form in [
                    key.clone(),
                    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\"")),
                ] {
                    let Ok(value) = HeaderValue::from_str(&form) else {
                        continue; // not even a header value
                    };
                    let a = send(
                        h.http
                            .post(format!("{}/key-json", h.url))
                            .header("idempotency-key", value)
                            .body("{}"),
                    )
                    .await;
                    if a.status.is_success() {
                        assert_ne!(
                            a.json()["key"],
                            key.as_str(),
                            "{form:?} accepted as {key:?}"
                        );
                    } else {
                        a.assert_problem(400, "invalid-key");
                    }
                }
            }
            Err(e) => panic!("{key:?}: {e}"),
        }
    }
    assert_eq!(h.runs(), sent);
    assert!(sent > 90, "{sent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_headers_are_configurable() {
    let h = Harness::start(|l| {
        l.tenant_from_headers([axum::http::HeaderName::from_static("x-api-key")])
    })
    .await;
    let with = |api_key: &str, auth: &str| {
        h.post("/pay", "k")
            .header("x-api-key", api_key)
            .header("authorization", auth)
    };
    let a = send(with("key-a", "Bearer 1")).await;
    let b = send(with("key-b", "Bearer 1")).await;
    assert!(!b.replayed(), "another API key is another key space");
    // Authorization no longer counts: same API key, same space.
    let a2 = send(with("key-a", "Bearer 2")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_response_body_is_a_500_and_releases_the_key() {
    let h = Harness::start(|l| l).await;
    let a = send(h.post("/failing-body", "fb-1")).await;
    a.assert_problem(500, "response-failed");
    assert_eq!(h.runs(), 1);
    assert!(h.key_is_free("fb-1").await);
}
