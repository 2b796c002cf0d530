//! `Prefer: wait=N` over real sockets, on the in-process MemoryStore and
//! on a private Redis (pub/sub notifications): duplicates of a request
//! whose handler is held on a gate wait for its response and get it
//! replayed; the handler runs once; the wait is capped, reported in
//! `Preference-Applied`, and its end or a failed first request answered as
//! documented. The last test drives the server with Python's `requests`.

use crate::support::{Answer, send, serve};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_core::{Idempotency, MemoryStore};
use idem_http::IdempotencyLayer;
use idem_redis::RedisStore;
use idem_testkit::{RedisServer, eventually};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;
use tokio::sync::Semaphore;

/// What the handlers did, and the gate that holds their first run.
#[derive(Clone)]
struct Held {
    /// Handler runs, counted as each starts.
    runs: Arc<AtomicUsize>,
    /// Requests that reached the server (counted outside the layer).
    arrived: Arc<AtomicUsize>,
    /// The first run waits here until the test adds a permit.
    gate: Arc<Semaphore>,
}

impl Held {
    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    fn open(&self) {
        self.gate.add_permits(1);
    }

    /// Waits (at most 30 s) until `n` requests reached the server, then
    /// gives their claims a moment to reach the store: a duplicate that
    /// claims only after the gate opens gets a plain replay, which the
    /// assertions accept too, so this only makes the test stronger.
    async fn until_arrived(&self, n: usize) {
        eventually(
            "every request reached the server",
            Duration::from_secs(30),
            || std::future::ready((self.arrived.load(SeqCst) >= n).then_some(())),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `/charge`: 201 with a JSON body and headers numbered by its run; the
/// first run is held on the gate.
async fn charge(State(h): State<Held>, body: Bytes) -> Response {
    let n = h.runs.fetch_add(1, SeqCst) + 1;
    if n == 1 {
        h.gate.acquire().await.expect("gate open").forget();
    }
    let mut r = (
        StatusCode::CREATED,
        format!(r#"{{"charge":{n},"request_bytes":{}}}"#, body.len()),
    )
        .into_response();
    let headers = r.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-charge-id", HeaderValue::from(n));
    headers.append("x-multi", HeaderValue::from_static("one"));
    headers.append("x-multi", HeaderValue::from_static("two"));
    r
}

/// `/flaky`: the first run, held on the gate, answers 503 (which releases
/// the key); later runs answer 201 at once.
async fn flaky(State(h): State<Held>) -> Response {
    let n = h.runs.fetch_add(1, SeqCst) + 1;
    if n == 1 {
        h.gate.acquire().await.expect("gate open").forget();
        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
    }
    (StatusCode::CREATED, format!("charged by run {n}")).into_response()
}

/// A server of the two routes behind `layer`, the requests counted as
/// they arrive.
struct Server {
    url: String,
    held: Held,
    http: reqwest::Client,
    _redis: Option<RedisServer>,
}

impl Server {
    async fn start(
        idem: Idempotency,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Server {
        Server::start_with(idem, None, configure).await
    }

    async fn start_with(
        idem: Idempotency,
        redis: Option<RedisServer>,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Server {
        let held = Held {
            runs: Arc::default(),
            arrived: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        };
        let arrived = held.arrived.clone();
        let app = Router::new()
            .route("/charge", post(charge))
            .route("/flaky", post(flaky))
            .with_state(held.clone())
            .layer(configure(IdempotencyLayer::new(idem)))
            .layer(tower::util::MapRequestLayer::new(
                move |r: axum::extract::Request| {
                    arrived.fetch_add(1, SeqCst);
                    r
                },
            ));
        Server {
            url: serve(app).await,
            held,
            http: reqwest::Client::new(),
            _redis: redis,
        }
    }

    fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("idempotency-key", key)
            .body(r#"{"amount":500}"#)
    }

    /// Sends the first request, and waits until its handler runs (held).
    async fn first(&self, path: &str, key: &str) -> tokio::task::JoinHandle<Answer> {
        let first = tokio::spawn(send(self.post(path, key)));
        eventually(
            "the first request's handler runs",
            Duration::from_secs(30),
            || std::future::ready((self.held.runs() >= 1).then_some(())),
        )
        .await;
        first
    }
}

fn memory() -> Idempotency {
    Idempotency::builder(MemoryStore::new())
        .namespace("prefer-wait")
        .build()
}

/// A private Redis, and a runtime over a store connected by URL (so it
/// subscribes to notifications).
async fn redis() -> (Idempotency, RedisServer) {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .expect("connect to the private redis-server the test started");
    let idem = Idempotency::builder(store).namespace("prefer-wait").build();
    (idem, server)
}

/// The headers a replay repeats: the response's own, less `date` and what
/// the layer adds to a replay.
fn original_headers(answer: &Answer) -> HeaderMap {
    let mut h = answer.headers.clone();
    for name in ["date", "idempotent-replayed", "preference-applied"] {
        h.remove(name);
    }
    h
}

/// The forms of one preference, `wait=5`, a duplicate may send it in
/// (RFC 7240: among others, several fields, any case, a quoted value).
fn prefer_wait_5(request: reqwest::RequestBuilder, i: usize) -> reqwest::RequestBuilder {
    match i % 4 {
        0 => request.header("prefer", "wait=5"),
        1 => request.header("prefer", "respond-async, wait=5"),
        2 => request
            .header("prefer", "return=minimal")
            .header("prefer", "Wait=\"5\""),
        _ => request.header("prefer", "handling=lenient; x=1, WAIT = 5"),
    }
}

/// 64 concurrent duplicates with `Prefer: wait=5`, sent while the first
/// request's handler is held: none is answered while it is held (each
/// waits), and once it finishes every one gets the original response
/// (status, body and headers as the first got them) marked as a replay with
/// `Preference-Applied: wait=5`; the handler ran once.
async fn sixty_four_waiting_duplicates(server: Server) {
    let first = server.first("/charge", "dup").await;
    let duplicates: Vec<_> = (0..64)
        .map(|i| tokio::spawn(send(prefer_wait_5(server.post("/charge", "dup"), i))))
        .collect();
    server.held.until_arrived(65).await;
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "a duplicate was answered while the first request still ran: it did not wait"
    );
    server.held.open();
    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.header("preference-applied"), None);
    for d in duplicates {
        let d = d.await.expect("duplicate");
        assert_eq!(d.status, first.status, "{:?}", d.body);
        assert_eq!(d.body, first.body);
        assert_eq!(original_headers(&d), original_headers(&first));
        assert!(d.replayed());
        assert_eq!(d.header("preference-applied"), Some("wait=5"));
    }
    assert_eq!(server.held.runs(), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_waiting_duplicates_get_the_original_response_memory_store() {
    sixty_four_waiting_duplicates(Server::start(memory(), |l| l).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_waiting_duplicates_get_the_original_response_redis() {
    let (idem, redis) = redis().await;
    sixty_four_waiting_duplicates(Server::start_with(idem, Some(redis), |l| l).await).await;
}

/// Without `Prefer` (and without the layer's `wait`) a duplicate of a
/// running request is refused `409` at once, as the IETF draft has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_without_prefer_gets_409_while_the_first_runs() {
    let server = Server::start(memory(), |l| l).await;
    let first = server.first("/charge", "plain").await;
    let dup = send(server.post("/charge", "plain")).await;
    dup.assert_problem_409();
    assert_eq!(dup.header("preference-applied"), None);
    server.held.open();
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(server.held.runs(), 1);
}

/// A wait that ends before the first request's response is stored is
/// answered `409` as without one, with the wait it was granted in
/// `Preference-Applied`; the handler is not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_shorter_than_the_handler_ends_in_409() {
    let server = Server::start(memory(), |l| l).await;
    let first = server.first("/charge", "short").await;
    let dup = send(server.post("/charge", "short").header("prefer", "wait=1")).await;
    dup.assert_problem_409();
    assert_eq!(dup.header("preference-applied"), Some("wait=1"));
    server.held.open();
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(server.held.runs(), 1);
}

/// A wait over `max_wait` is cut to it, and `Preference-Applied` says so:
/// the default cap (10 s) on a completed key's replay, a cap of 1 s on a
/// wait that ends in `409` and on the replay after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_is_capped_by_max_wait() {
    let server = Server::start(memory(), |l| l).await;
    let first = server.first("/charge", "capped").await;
    server.held.open();
    assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    let replay = send(
        server
            .post("/charge", "capped")
            .header("prefer", "wait=3600"),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.header("preference-applied"), Some("wait=10"));

    let server = Server::start(memory(), |l| l.max_wait(Duration::from_secs(1))).await;
    let first = server.first("/charge", "capped").await;
    let dup = send(
        server
            .post("/charge", "capped")
            .header("prefer", "wait=3600"),
    )
    .await;
    dup.assert_problem_409();
    assert_eq!(dup.header("preference-applied"), Some("wait=1"));
    server.held.open();
    let first = first.await.expect("first");
    let replay = send(
        server
            .post("/charge", "capped")
            .header("prefer", "wait=3600"),
    )
    .await;
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("preference-applied"), Some("wait=1"));
    assert_eq!(server.held.runs(), 1);
}

/// A `Prefer` the layer cannot honour is ignored, never an error (RFC
/// 7240): a malformed wait, or any wait under `max_wait(0)`, is a plain
/// duplicate (`409`, no `Preference-Applied`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefer_that_cannot_be_honoured_is_ignored() {
    let server = Server::start(memory(), |l| l).await;
    let first = server.first("/charge", "bad").await;
    for prefer in ["wait=soon", "wait=-1", "wait=1.5", "wait", "respond-async"] {
        let dup = send(server.post("/charge", "bad").header("prefer", prefer)).await;
        dup.assert_problem_409();
        assert_eq!(dup.header("preference-applied"), None, "{prefer}");
    }
    server.held.open();
    first.await.expect("first");

    let server = Server::start(memory(), |l| l.max_wait(Duration::ZERO)).await;
    let first = server.first("/charge", "off").await;
    let dup = send(server.post("/charge", "off").header("prefer", "wait=5")).await;
    dup.assert_problem_409();
    assert_eq!(dup.header("preference-applied"), None);
    server.held.open();
    first.await.expect("first");
    assert_eq!(server.held.runs(), 1);
}

/// When the first request fails (a 503 releases its key) while duplicates
/// wait, the key is free again and the waiters are retries of it: one of
/// them claims the key and runs the handler (its own response, not a
/// replay), the others wait on and get that response replayed. The
/// handler ran twice in all: the failed run and one more.
async fn a_failed_first_request_is_run_by_one_waiter(server: Server) {
    let first = server.first("/flaky", "failed").await;
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(send(
                server.post("/flaky", "failed").header("prefer", "wait=5"),
            ))
        })
        .collect();
    server.held.until_arrived(9).await;
    server.held.open();
    let first = first.await.expect("first");
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    let mut answers = Vec::new();
    for w in waiters {
        answers.push(w.await.expect("waiter"));
    }
    assert!(answers.iter().all(|a| a.status == StatusCode::CREATED));
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    let ran: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(ran.len(), 1, "one waiter ran the handler");
    assert_eq!(ran[0].header("preference-applied"), None);
    for a in answers.iter().filter(|a| a.replayed()) {
        assert_eq!(a.header("preference-applied"), Some("wait=5"));
    }
    assert_eq!(server.held.runs(), 2, "the failed run and one waiter's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_request_is_run_by_one_waiter_memory_store() {
    a_failed_first_request_is_run_by_one_waiter(Server::start(memory(), |l| l).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_request_is_run_by_one_waiter_redis() {
    let (idem, redis) = redis().await;
    a_failed_first_request_is_run_by_one_waiter(Server::start_with(idem, Some(redis), |l| l).await)
        .await;
}

impl Answer {
    /// `409 key-in-use`, with its retry hint.
    fn assert_problem_409(&self) {
        assert_eq!(self.status, StatusCode::CONFLICT, "{:?}", self.body);
        let problem = self.json();
        assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("key-in-use")),
            "{problem}"
        );
        assert_eq!(self.header("retry-after"), Some("1"));
        assert!(!self.replayed());
    }
}

/// Where `cargo xtask setup` installs `requests` when the system Python
/// lacks it.
fn requests_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("idem-requests")
}

fn require_requests() {
    let out = Command::new("python3")
        .args(["-c", "import requests"])
        .env("PYTHONPATH", requests_dir())
        .output()
        .expect("python3 runs the HTTP client: install Python 3 (cargo xtask setup)");
    assert!(
        out.status.success(),
        "the Python client needs `requests`, which python3 cannot import (nor from {}): {}; \
         run `cargo xtask setup` (it pip-installs it there)",
        requests_dir().display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// The client: N threads send one request at once, asserting as it goes;
/// prints `ok` last.
const CLIENT: &str = r#"
import sys, threading
import requests

url, n = sys.argv[1], int(sys.argv[2])
headers = {"Idempotency-Key": "py-1", "Content-Type": "application/json",
           "Prefer": "respond-async, wait=5"}
results = [None] * n
start = threading.Barrier(n)

def send(i):
    with requests.Session() as s:
        start.wait()
        r = s.post(url, data=b'{"amount":500}', headers=headers, timeout=60)
        results[i] = r

threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
assert all(r is not None for r in results), "every thread got an answer"
assert all(r.status_code == 201 for r in results), [(r.status_code, r.text) for r in results]
assert len({r.content for r in results}) == 1, "one body: " + repr({r.content for r in results})
assert len({r.headers["X-Charge-Id"] for r in results}) == 1
ran = [r for r in results if "Idempotent-Replayed" not in r.headers]
replays = [r for r in results if r.headers.get("Idempotent-Replayed") == "true"]
assert len(ran) == 1 and len(replays) == n - 1, [dict(r.headers) for r in results]
assert "Preference-Applied" not in ran[0].headers
assert all(r.headers["Preference-Applied"] == "wait=5" for r in replays)

# A retry without Prefer, later: the same body, no Preference-Applied.
again = requests.post(url, data=b'{"amount":500}', headers={"Idempotency-Key": "py-1",
                      "Content-Type": "application/json"}, timeout=60)
assert again.status_code == 201 and again.content == results[0].content
assert again.headers["Idempotent-Replayed"] == "true"
assert "Preference-Applied" not in again.headers
print("ok")
"#;

/// Python's `requests` in 8 threads sends one request with
/// `Prefer: respond-async, wait=5` at once, the handler held until all 8
/// arrived: every thread gets the same 201 body, one of them the handler's
/// own response and 7 a replay with `Preference-Applied: wait=5`; the
/// handler ran once (Redis store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_threads_waiting_on_one_key_get_one_response() {
    require_requests();
    let (idem, redis) = redis().await;
    let server = Server::start_with(idem, Some(redis), |l| l).await;
    let threads = 8;
    let held = server.held.clone();
    let opener = tokio::spawn(async move {
        held.until_arrived(threads).await;
        held.open();
    });
    let url = format!("{}/charge", server.url);
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", CLIENT, &url, &threads.to_string()])
            .env("PYTHONPATH", requests_dir())
            .output()
            .expect("python3 runs")
    })
    .await
    .expect("the client's thread");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "the Python client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    opener.await.expect("the gate opened");
    assert_eq!(server.held.runs(), 1, "the handler ran once");
}
