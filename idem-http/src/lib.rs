//! # idem-http
//!
//! A tower [`Layer`](tower_layer::Layer) that gives axum (or any hyper/tower)
//! servers `Idempotency-Key` semantics: a client that retries a `POST` with
//! the same key gets the first response again instead of a second charge,
//! order or e-mail. An [`idem_core::Idempotency`] runtime (Redis, or memory in
//! one process) is the arbiter, so it holds across server instances.
//! Re-exported by the `idem` crate as `idem::http` (feature `http`).
//!
//! ```
//! use axum::{Json, Router, http::StatusCode, routing::post};
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_http::IdempotencyLayer;
//! use serde_json::{Value, json};
//! use std::time::Duration;
//! use tower::ServiceExt; // for `oneshot`
//!
//! async fn create_payment(Json(req): Json<Value>) -> (StatusCode, Json<Value>) {
//!     // ... charge the card: runs once per Idempotency-Key ...
//!     (StatusCode::CREATED, Json(json!({ "id": "pay_1", "amount": req["amount"] })))
//! }
//!
//! fn app(idem: Idempotency) -> Router {
//!     Router::new().route("/payments", post(create_payment)).layer(
//!         IdempotencyLayer::new(idem)
//!             .require_key(true) // 400 without the header
//!             .tenant(|parts: &http::request::Parts| {
//!                 // each API client gets its own key space
//!                 parts.headers.get("x-api-key")?.to_str().ok().map(str::to_owned)
//!             })
//!             .retention(Duration::from_secs(24 * 3600))
//!             .advertise_retention(true)
//!             .problem_type_base("https://errors.example.com/idempotency/"),
//!     )
//! }
//!
//! // In production: a RedisStore, and `axum::serve`.
//! async fn serve(idem: Idempotency) -> std::io::Result<()> {
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app(idem)).await
//! }
//! # let _ = serve;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let app = app(Idempotency::builder(MemoryStore::new()).namespace("payments").build());
//! let request = || {
//!     http::Request::post("/payments")
//!         .header("idempotency-key", "5f0c7a3e-1c2b-4d5e-8f90-0123456789ab")
//!         .header("content-type", "application/json")
//!         .body(axum::body::Body::from(r#"{"amount":500}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! assert_eq!(first.headers()["idempotency-retention"], "86400");
//!
//! let retry = app.clone().oneshot(request()).await.unwrap(); // handler not run
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # });
//! ```
//!
//! ## What the layer does
//!
//! Requests whose method is not in [`methods`](IdempotencyLayer::methods)
//! (default `POST` and `PATCH`), and those the
//! [`bypass`](IdempotencyLayer::bypass) predicate picks, pass through
//! untouched. For the others:
//!
//! | situation | answer |
//! | --- | --- |
//! | no `Idempotency-Key` | passes through without idempotency, or `400` [`missing-key`](#missing-key) with [`require_key(true)`](IdempotencyLayer::require_key) |
//! | malformed key, header sent twice | `400` [`invalid-key`](#invalid-key) |
//! | body over [`max_request_body`](IdempotencyLayer::max_request_body) (1 MiB) | `413` [`request-too-large`](#request-too-large) |
//! | first request with this key | the handler runs (in a task of its own: a client that disconnects does not stop it); its response streams to the client and, if storable, is stored |
//! | same key, handler still running | `409` [`key-in-use`](#key-in-use) with `Retry-After` ([`retry_after`](IdempotencyLayer::retry_after), default 1 s); with [`wait`](IdempotencyLayer::wait) it first waits that long for the response, then gets it replayed |
//! | same key, handler still running, `Prefer: wait=N` | waits up to `N` s (at most [`max_wait`](IdempotencyLayer::max_wait), 10 s) for the response, then gets it replayed; `409` when the wait ends first; either with `Preference-Applied: wait=<granted>` (see [`Prefer: wait`](#prefer-wait)) |
//! | same key, completed | the stored status, headers and body, with `Idempotent-Replayed: true`; the handler does not run |
//! | same key, processed but its response not kept (over [`max_response_body`](IdempotencyLayer::max_response_body), or `text/event-stream`) | `410` [`response-not-kept`](#response-not-kept); the handler does not run |
//! | same key, another method, path, query or body | `422` [`key-reused`](#key-reused) |
//! | store unreachable | `503` [`store-unavailable`](#store-unavailable) with `Retry-After`; the handler does not run (fail-closed: the runtime's default `FailMode::Closed`; with `FailMode::Open` it runs unprotected) |
//!
//! **The key.** A bare token (`Idempotency-Key: 5f0c7a3e-…`, visible ASCII,
//! no spaces) or a structured-field string (`Idempotency-Key: "5f0c 7a3e"`,
//! escapes `\"` and `\\`); both forms of the same characters are the same
//! key. 1–255 printable ASCII characters after unquoting, not all spaces;
//! see [`parse_idempotency_key`]. The grammar is shared with `idem-client`
//! (crate `idem-key`), which never sends a key this layer refuses. The
//! parsed key is put in the request's
//! extensions as an [`IdempotencyKey`].
//!
//! **The fingerprint.** SHA-256 over the method, the path, the query string
//! and the body bytes (each length-prefixed), stored with the claim. The body
//! is buffered for that, up to the request limit, and handed to the handler
//! as it was.
//!
//! **What is stored.** Responses with a 2xx, 3xx or 4xx status, except 401,
//! 403 and 407 (a client that fixes its credentials must not get the old
//! refusal back) and 408, 409, 425 and 429, whose body ends within
//! [`max_response_body`](IdempotencyLayer::max_response_body) (1 MiB). Stored:
//! status, body, and the headers except hop-by-hop ones (`Connection` and
//! those it names, `Keep-Alive`, `Transfer-Encoding`, `TE`, `Trailer`,
//! `Upgrade`, `Proxy-*`), `Date`, `Content-Length` (recomputed) and
//! `Set-Cookie` (unless [`replay_set_cookie(true)`](IdempotencyLayer::replay_set_cookie)).
//! Custom headers (`Location`, `X-Request-Id`, …) are replayed. Trailers are
//! dropped. The record is JSON: status, headers and body, with UTF-8 bytes as
//! strings and other bytes in base64.
//!
//! **Streaming.** A response body that is complete at once (the usual JSON
//! body) is stored, then sent. Any other body streams to the client from
//! its first frame while a copy is kept: when it ends within the limit the
//! copy is stored (before the client sees the end of the body, so a retry
//! sent right after finds it); when it passes the limit, a marker saying
//! "processed, response not kept" is stored **at once** and the rest streams
//! on. A duplicate then gets `410` [`response-not-kept`](#response-not-kept),
//! never a second run, and never an endless `409`. Responses whose
//! `Content-Length` is over the limit, and content types listed in
//! [`stream_content_types`](IdempotencyLayer::stream_content_types) (default
//! `text/event-stream`), are not buffered at all: the marker is stored at
//! once and the body streams through. A route that must not be claimed at
//! all (an SSE endpoint taking `POST`, say) goes in
//! [`bypass`](IdempotencyLayer::bypass).
//!
//! **`Prefer: wait`.** <a id="prefer-wait"></a> A client that would rather
//! wait than retry sends `Prefer: wait=N` (RFC 7240: whole seconds; the
//! preference may stand among others, `Prefer: respond-async, wait=10`,
//! in any case, in any of several `Prefer` fields; only the first `wait`
//! counts). A duplicate of a request still running then waits up to
//! `min(N, max_wait)` ([`max_wait`](IdempotencyLayer::max_wait), 10 s by
//! default; zero ignores the preference) instead of the layer's
//! [`wait`](IdempotencyLayer::wait), and:
//!
//! * the response is stored meanwhile: the duplicate gets it as any replay
//!   (stored status, headers and body, `Idempotent-Replayed: true`), with
//!   `Preference-Applied: wait=<granted seconds>` ([`PREFERENCE_APPLIED`]);
//! * the wait ends first: `409` [`key-in-use`](#key-in-use) as without it,
//!   with the same `Preference-Applied`;
//! * the first request fails and releases its key (a 5xx, a panic, …): the
//!   key is free, and a waiting duplicate is a retry like any other, so one
//!   of them claims the key and runs the handler (its response is the
//!   handler's own, without `Preference-Applied`); the others wait on for
//!   that one's response. The IETF draft has a retry after a failure run
//!   again, which this is.
//!
//! A value that is not whole seconds (`wait=soon`, `wait=1.5`) is ignored,
//! as RFC 7240 has servers ignore preferences they cannot honour: the
//! request is a plain duplicate (`409`). The request that runs the handler
//! gets the handler's response untouched, `Prefer` or not. The wait is
//! woken by the store (the MemoryStore in process, a RedisStore by
//! pub/sub); a store without notifications (PostgreSQL, a RedisStore made
//! from a connection) is read again, 5 ms doubling up to 250 ms apart.
//! The IETF draft answers a duplicate in flight `409`; waiting is an
//! opt-in of the client's, which a request without `Prefer` never gets.
//!
//! **Client disconnects.** Hyper drops a request's future when its client
//! goes away, for instance when the client's timeout fires. The layer runs
//! each claimed request in a Tokio task of its own, so a started handler
//! runs to completion anyway and its response is stored: the client's retry
//! gets `409` while it runs, then the stored response. A body still
//! streaming when the client leaves is read on (up to the limit) to store
//! it. With [`cancel_on_disconnect(true)`](IdempotencyLayer::cancel_on_disconnect)
//! a disconnect instead drops the handler at its next `.await`; as any call
//! dropped mid-body, it keeps its key until the lease ends (it may have made
//! effects), and the retry after that runs the handler again. Clients should give slow handlers time: `idem-client`'s default
//! per-attempt timeout is 30 s, its whole retry budget, and a retry after a
//! timeout is safe either way.
//!
//! **Compression.** Put compression layers *outside* this one, so that
//! stored responses are uncompressed and each client gets the coding it
//! accepts. A compression layer inside it makes the stored body compressed:
//! a replay to a request whose `Accept-Encoding` does not accept that
//! coding (no `Accept-Encoding` counts as identity only) gets the body
//! decoded (`gzip`, `deflate`), or `406`
//! [`encoding-not-acceptable`](#encoding-not-acceptable) for codings the
//! layer cannot decode (`br`, `zstd`). Other request headers a response
//! `Vary`s on are not renegotiated: a key names one operation, and its
//! answer is the one its first request got.
//!
//! **What releases the key** (the next request with it runs the handler):
//! a 1xx or 5xx status, 401, 403, 407, 408, 409, 425 and 429 (the response
//! is sent as it is and never replayed); a response body that fails or
//! panics before it passed the limit; an error of the inner service; a
//! handler that **panics** — the layer catches the panic (the inner
//! service's future, its `call`, and the response body while the layer
//! reads it), logs it at `error` level and answers `500`
//! [`handler-panicked`](#handler-panicked) when nothing was sent yet (a body
//! that panics after its first bytes went out is cut short), so the client
//! gets an answer and the server a free key. A dropped connection, even
//! with [`cancel_on_disconnect(true)`](IdempotencyLayer::cancel_on_disconnect),
//! does not: the handler it stops keeps its key until the lease ends.
//!
//! The layer needs a Tokio runtime (as axum does); without one it answers
//! `500` [`internal-error`](#internal-error).
//!
//! **Several layers.** A request that an outer `IdempotencyLayer` already
//! handles (it carries an [`IdempotencyKey`] extension) passes through inner
//! ones untouched, so a router-wide optional layer and a route-level
//! `require_key(true)` layer combine: the route refuses requests without a
//! key, and a request with one is claimed once, by the outer layer.
//!
//! ## Keys, scopes and tenants
//!
//! Keys are stored as `namespace:scope:key` by the runtime, where the
//! namespace is the runtime's and the scope is
//! [`scope`](IdempotencyLayer::scope) (default `"http"`) followed, when the
//! request has a tenant, by `|` and the tenant. The tenant is
//! percent-escaped (`%`, `|`, `#`, control characters; the runtime escapes
//! `:`), or replaced by `#` and its SHA-256 when long, so no two tenants,
//! nor a tenant and the tenant-less space, share a key.
//!
//! **Isolation is the default.** Without configuration the tenant is a
//! digest of the request's `Authorization` header (`cred:` and 128 bits of
//! SHA-256; the credentials never reach the store): principal B sending A's
//! key and body runs its own operation rather than getting A's response,
//! and B's other body under A's key cannot block A. Requests without the
//! header share the tenant-less space. Change the headers with
//! [`tenant_from_headers`](IdempotencyLayer::tenant_from_headers), name
//! tenants yourself with [`tenant`](IdempotencyLayer::tenant) (the
//! authenticated principal's id is best: it survives credential rotation),
//! or opt into one key space for all with
//! [`shared_keys`](IdempotencyLayer::shared_keys).
//!
//! Method and path are not part of the scope (as with Stripe, a key names
//! one operation of one tenant): they are in the fingerprint, so a key reused
//! on another route is a `422`, not a second operation. Give layers
//! different scopes to make their key spaces independent.
//!
//! ## Retention
//!
//! A completed response is replayed for
//! [`retention`](IdempotencyLayer::retention) (default: the runtime's `result_ttl`), passed as the
//! TTL of each call. With [`advertise_retention(true)`](IdempotencyLayer::advertise_retention)
//! the first response and every replay carry
//! `Idempotency-Retention: <seconds>` ([`IDEMPOTENCY_RETENTION`]).
//!
//! ## Tracing
//!
//! A request the layer covers runs in an `idem.http` span (fields
//! `method`, `path`), the parent of its `idem.call`. With feature `otel`,
//! when the request arrives under no span of the application's that
//! carries a trace (tower-http's `TraceLayer` with OpenTelemetry, say),
//! `idem.http` is the request's server span and continues the caller's
//! trace from its `traceparent` header (W3C trace context); under such a
//! span it is an internal child of it, so a request never has two server
//! spans.
//!
//! ## Problem types
//!
//! Errors the layer answers itself are `application/problem+json` (RFC 9457)
//! with `type`, `title`, `status` and `detail`. The `type` is
//! [`problem_type_base`](IdempotencyLayer::problem_type_base) (default: this
//! section) followed by the slug below ([`ProblemKind`]).
//!
//! ### invalid-key
//! `400`: the `Idempotency-Key` header is malformed or sent twice.
//! ### missing-key
//! `400`: the route requires an `Idempotency-Key`.
//! ### unreadable-request
//! `400`: the request body could not be read.
//! ### encoding-not-acceptable
//! `406`: the stored response is compressed with a coding this request does
//! not accept and the layer cannot decode; send `Accept-Encoding` with it.
//! ### key-in-use
//! `409`: a request with this key is in flight; retry after `Retry-After`.
//! ### response-not-kept
//! `410`: the request with this key **was processed**, but its response was
//! not kept (its body passed
//! [`max_response_body`](IdempotencyLayer::max_response_body), or it was a
//! stream such as `text/event-stream`), so it cannot be replayed. The
//! member `processed_status` holds the status the handler answered. Not
//! retryable, and the operation must not be sent again under a new key:
//! look its result up another way (`idem-client` returns
//! `ClientErrorKind::ResponseNotKept`).
//! ### request-too-large
//! `413`: the body is over the layer's buffering limit.
//! ### key-reused
//! `422`: the key was used with a different request; use a new key.
//! ### handler-panicked
//! `500`: the handler (or its response body, before any of it was sent)
//! panicked; the key was released, retrying is safe.
//! ### response-failed
//! `500`: the response body failed; the key was released.
//! ### internal-error
//! `500`: a stored response cannot be replayed, or the configuration is invalid.
//! ### store-unavailable
//! `503`: the idempotency store is unreachable; the handler did not run.
// Nothing on a request's path may panic: errors are responses.
mod answer;
mod body;
mod config;
mod encoding;
mod key;
mod layer;
mod prefer;
mod problem;
mod run;
mod service;
mod stored;

pub use idem_layer::settings::MaxLease;
pub use key::{IdempotencyKey, KeyError, KeyHeaderError, MAX_KEY_LEN, parse_idempotency_key};
pub use layer::{
    DEFAULT_BODY_LIMIT, DEFAULT_PROBLEM_TYPE_BASE, DEFAULT_SCOPE, DEFAULT_STREAM_CONTENT_TYPE,
    IdempotencyLayer,
};
pub use problem::{PROBLEM_JSON, ProblemKind};
pub use service::{IdempotencyService, ResponseFuture};

use http::HeaderName;

/// `Idempotency-Key`: the request header carrying the key.
///
/// ```
/// assert_eq!(idem_http::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed: true`: set on responses replayed from the store.
///
/// ```
/// assert_eq!(idem_http::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotency-Retention: <seconds>`: how long a completed response is
/// replayed, sent with [`IdempotencyLayer::advertise_retention`].
///
/// ```
/// assert_eq!(idem_http::IDEMPOTENCY_RETENTION, "idempotency-retention");
/// ```
pub const IDEMPOTENCY_RETENTION: HeaderName = HeaderName::from_static("idempotency-retention");

/// `Prefer`: the request header (RFC 7240) whose `wait=N` preference has a
/// duplicate of an in-flight request wait up to `N` seconds for its
/// response (see [`IdempotencyLayer::max_wait`]).
///
/// ```
/// assert_eq!(idem_http::PREFER, "prefer");
/// ```
pub const PREFER: HeaderName = HeaderName::from_static("prefer");

/// `Preference-Applied: wait=N` (RFC 7240): on the answers to a duplicate
/// that asked to wait, the wait it was granted, in seconds (capped by
/// [`IdempotencyLayer::max_wait`]).
///
/// ```
/// assert_eq!(idem_http::PREFERENCE_APPLIED, "preference-applied");
/// ```
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
