//! The harness the layer's test files share: an axum app of test handlers
//! over a private Redis (idem-testkit), served on 127.0.0.1:0 and driven
//! with reqwest, with exact handler counts.
//!
//! Each test file is its own crate and uses a part of this module, hence
//! the `dead_code` allowance.
#![allow(dead_code)]

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use idem_core::{Idempotency, IdempotencyBuilder, Outcome};
use idem_http::{IdempotencyKey, IdempotencyLayer};
use idem_redis::{RedisStore, RedisStoreConfig};
use idem_testkit::{RedisServer, eventually};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// The problem-type base every harness layer is built with.
pub(crate) const PROBLEM_BASE: &str = "https://errors.example.com/idempotency/";

/// What the test handlers did, shared with the test through the app state.
#[derive(Clone, Default)]
pub(crate) struct Counters {
    /// Handler runs (every handler increments it first).
    pub runs: Arc<AtomicUsize>,
    /// Slow handlers that finished.
    pub done: Arc<AtomicUsize>,
    /// Slow handlers whose future was dropped before finishing.
    pub cancelled: Arc<AtomicUsize>,
    pub panicked: Arc<AtomicBool>,
    /// Streaming bodies dropped (the client went away, or they ended).
    pub streams_dropped: Arc<AtomicUsize>,
    /// Permits let `/gated` send the second half of its body.
    pub gate: Gate,
}

/// Holds `/gated` back mid-body until the test adds a permit.
#[derive(Clone)]
pub(crate) struct Gate(pub Arc<tokio::sync::Semaphore>);

impl Default for Gate {
    fn default() -> Self {
        Gate(Arc::new(tokio::sync::Semaphore::new(0)))
    }
}

impl Counters {
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }
}

/// A 201 with a JSON body, numbered `x-payment-id`, repeated headers and a cookie.
pub(crate) async fn pay(State(c): State<Counters>, body: Bytes) -> Response {
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

/// Counts a future dropped before it finished (disarmed by taking the counter).
pub(crate) struct CancelGuard(Option<Arc<AtomicUsize>>);
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

/// Bytes of the `/big` response: over the default 1 MiB response limit.
pub(crate) const BIG: usize = 2 * 1024 * 1024;

async fn big(State(c): State<Counters>) -> Response {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let mut body = vec![b'x'; BIG];
    body[0] = b'0' + (n % 10) as u8;
    body.into_response()
}

/// `n` double quotes: a body that doubles in size once JSON-escaped.
async fn quotes(State(c): State<Counters>, Path(n): Path<usize>) -> Response {
    c.runs.fetch_add(1, SeqCst);
    ([("content-type", "text/plain")], vec![b'"'; n]).into_response()
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

/// Every test handler at its path, over the given counters.
pub(crate) fn routes(c: &Counters) -> Router {
    Router::new()
        .route("/pay", post(pay).get(pay).put(pay).patch(pay))
        .route("/pay2", post(pay))
        .route("/binary", post(binary))
        .route("/slow", post(slow))
        .route("/status/{code}", post(status))
        .route("/panic-once", post(panic_once))
        .route("/big", post(big))
        .route("/big-stream", post(big_stream))
        .route("/quotes/{n}", post(quotes))
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

/// A private Redis, the routes behind one configured layer, and an HTTP client.
pub(crate) struct Harness {
    pub url: String,
    pub counters: Counters,
    pub http: reqwest::Client,
    pub redis: RedisServer,
}

impl Harness {
    /// Redis, a runtime over it, and the routes behind `configure(layer)`.
    pub(crate) async fn start(
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Harness {
        Harness::start_with_runtime(|b| b, configure).await
    }

    /// [`start`](Self::start), the runtime configured by `runtime` too.
    pub(crate) async fn start_with_runtime(
        runtime: impl FnOnce(IdempotencyBuilder) -> IdempotencyBuilder,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Harness {
        let redis = RedisServer::start();
        let idem = runtime(builder_over(&redis).await).build();
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

    pub(crate) fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("idempotency-key", key)
            .body(r#"{"amount":500}"#)
    }

    pub(crate) fn runs(&self) -> usize {
        self.counters.runs()
    }

    /// Whether `key` (of the tenant-less key space) is free, found without
    /// running any handler: a direct call claims it, runs nothing of the
    /// app's, and says whether it executed. Waits out a claim still being
    /// released.
    pub(crate) async fn key_is_free(&self, key: &str) -> bool {
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

/// An idem runtime over `redis` with short timeouts, so a killed server fails fast.
pub(crate) async fn idem_over(redis: &RedisServer) -> Idempotency {
    builder_over(redis).await.build()
}

/// The builder of [`idem_over`]'s runtime.
pub(crate) async fn builder_over(redis: &RedisServer) -> IdempotencyBuilder {
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
}

/// Serves `app` on a free port of 127.0.0.1 and returns its base URL.
pub(crate) async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

/// A response read to the end: status, headers and body.
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    /// Asserts an RFC 9457 problem of the given status and type slug.
    pub(crate) fn assert_problem(&self, status: u16, slug: &str) {
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

/// Sends `request` and reads the whole response.
pub(crate) async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("request sent");
    Answer {
        status: response.status(),
        headers: response.headers().clone(),
        body: response.bytes().await.expect("response body"),
    }
}

/// Waits (at most 10 s) until `done` holds; never asserts how fast.
pub(crate) async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    eventually(what, Duration::from_secs(10), || {
        std::future::ready(done().then_some(()))
    })
    .await
}
