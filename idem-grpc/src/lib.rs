//! # idem-grpc
//!
//! Exactly-once unary RPCs for [tonic](https://docs.rs/tonic) services: a
//! tower [`Layer`](tower_layer::Layer) that runs each protected call once per
//! idempotency key and answers a retry with the first call's answer, byte
//! for byte (message, status and trailing metadata), with an
//! [`idem_core::Idempotency`] runtime (Redis/Valkey, PostgreSQL, or memory
//! in one process) as the arbiter, so it holds across server instances.
//! Re-exported by the `idem` crate as `idem::grpc` (feature `grpc`); the
//! client side is [`client`].
//!
//! ```
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_grpc::{IdempotencyLayer, UnaryMethod};
//!
//! // A message as tonic-prost-build generates it (AIP-155's request_id).
//! #[derive(Clone, PartialEq, prost::Message)]
//! pub struct CreatePaymentRequest {
//!     #[prost(string, tag = "1")]
//!     pub request_id: String,
//!     #[prost(int64, tag = "2")]
//!     pub amount_cents: i64,
//! }
//!
//! fn layer(idem: Idempotency) -> IdempotencyLayer {
//!     IdempotencyLayer::new(idem)
//!         // the key: the request's own request_id
//!         .method(
//!             UnaryMethod::new("/payments.v1.Payments/CreatePayment")
//!                 .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone())),
//!         )
//!         // the key: the `idempotency-key` metadata entry
//!         .unary("/payments.v1.Payments/RefundPayment")
//! }
//!
//! // In production: a RedisStore, and
//! // Server::builder().layer(layer(idem)).add_service(PaymentsServer::new(svc)).serve(addr)
//! let layer = layer(Idempotency::builder(MemoryStore::new()).namespace("payments").build());
//! # let _ = layer;
//! ```
//!
//! The request types and `PaymentsServer` are your `.proto`'s code as
//! `tonic-prost-build` generates it, in a build script
//! (`tonic_prost_build::compile_protos`, which needs `protoc`, or
//! `protox::compile` then `compile_fds` without it) included with
//! `tonic::include_proto!("<package>")`; docs/grpc.md has the build script.
//! `Server` is `tonic::transport::Server`.
//!
//! ## What the layer does
//!
//! It sees each call as HTTP/2 (`Server::builder().layer(..)`): the method
//! path, the metadata, the length-prefixed request message. Methods you
//! did not declare pass through untouched, unless the call carries an
//! `idempotency-key` entry: then it is refused (`UNIMPLEMENTED`,
//! `not-unary`), so a streaming method, or one you forgot, never runs
//! unprotected for a caller who asked for protection. For the declared
//! unary methods:
//!
//! | situation | answer |
//! | --- | --- |
//! | no key | runs without idempotency, or `INVALID_ARGUMENT` (`missing-key`) with [`require_key(true)`](IdempotencyLayer::require_key) |
//! | malformed key (metadata or request field), metadata entry sent twice (on a method keyed by metadata) | `INVALID_ARGUMENT` (`invalid-key`) |
//! | a `-bin` tenant entry ([`tenant_from_metadata`](IdempotencyLayer::tenant_from_metadata)) that is not base64 | `INVALID_ARGUMENT` (`invalid-tenant`) |
//! | request not one gRPC message, or its key field does not decode | `INVALID_ARGUMENT` (`unreadable-request`) |
//! | more than one request message (client streaming) | `UNIMPLEMENTED` (`not-unary`) |
//! | compressed request message, when the key or fingerprint reads the message | `UNIMPLEMENTED` (`compressed-request`) |
//! | request over [`max_request_bytes`](IdempotencyLayer::max_request_bytes) (4 MiB) | `RESOURCE_EXHAUSTED` (`request-too-large`) |
//! | first call with this key | the handler runs in a task of its own (a client that goes away does not stop it); its answer is stored if it is `OK` (or a code of [`store_error_codes`](IdempotencyLayer::store_error_codes)), then sent |
//! | same key, first call still running | `ABORTED` (`key-in-use`) with `grpc-retry-pushback-ms`; with [`wait(d)`](IdempotencyLayer::wait) it first waits up to `d` (never past its deadline) for the answer and replays it (`idempotent-replayed: true`) |
//! | same key, first call still running, `idem-wait: N` | waits up to `N` s (at most [`max_wait`](IdempotencyLayer::max_wait), 10 s, and its deadline) for the answer and replays it; `ABORTED` when the wait ends first; either with [`idem-wait-applied-ms`](IDEM_WAIT_APPLIED_MS) |
//! | same key, completed | the stored initial metadata, message bytes and trailers (status, message, details, trailing metadata) + `idempotent-replayed: true`; the handler does not run |
//! | same key, processed but answer not kept (a stream, over [`max_response_bytes`](IdempotencyLayer::max_response_bytes), or its record over the runtime's `max_value_size`) | `FAILED_PRECONDITION` (`response-not-kept`) |
//! | same key, another request message (or method, under a shared scope) | `FAILED_PRECONDITION` (`key-reused`) |
//! | store unreachable | `UNAVAILABLE` (`store-unavailable`) with `grpc-retry-pushback-ms`; the handler does not run (the runtime's default `FailMode::Closed`; with `FailMode::Open` it runs unprotected) |
//! | the store did not confirm the call (a `Durability` the runtime asked for, a lease lost) | `UNAVAILABLE` (`store-not-confirmed`) with `grpc-retry-pushback-ms`; retry with the same key |
//! | handler panics, or its reply fails | `INTERNAL` (`handler-panicked`, `response-failed`); the key is released |
//! | handler answers an error status not opted in | that answer as it is; the key is released, a retry runs the handler again |
//!
//! Refusals the layer answers itself carry the slug in the [`IDEM_ERROR`]
//! metadata entry, so a client can tell a reused key from the handler's own
//! `FAILED_PRECONDITION`.
//!
//! **Why `FAILED_PRECONDITION` for a reused key.** gRPC's status guide
//! says `INVALID_ARGUMENT` is for arguments that are problematic
//! *regardless of the state of the system*, and `FAILED_PRECONDITION` for
//! a call refused because the system is not in the state it requires.
//! The second request is well-formed — under a fresh key it would run —
//! and is refused only because the key is already bound to another
//! request: state, not argument. Neither code is retried by gRPC clients,
//! and the `key-reused` slug says what to do: send it under a new key.
//!
//! **The key.** The `idempotency-key` metadata entry (`IDEMPOTENCY_KEY`),
//! with idem-http's grammar (crate `idem-key`): a bare token such as a
//! UUID, or a quoted string; 1–255 printable ASCII characters, not all
//! spaces. Or a field of the request message ([`UnaryMethod::key_from_request`]):
//! AIP-155's `request_id`, AEP-155's `idempotency_key.key`; the field then
//! replaces the metadata entry, which is not read at all.
//!
//! **The fingerprint.** SHA-256 over the method path and the request
//! message's bytes as sent (or the part [`UnaryMethod::fingerprint_request`]
//! picks), stored with the claim: the same key with another message is
//! `key-reused`, never a replay of another operation's answer. Protobuf
//! encoders are deterministic for one message value in one
//! implementation; a client that re-encodes a retry differently (map
//! order across languages) should fingerprint a part with its own stable
//! encoding.
//!
//! **The scope.** Keys are stored under `namespace:scope:key`; the scope is
//! the method's full path ([`UnaryMethod::scope`] to change it) followed,
//! when the call has a tenant, by `|` and the tenant (escaped, as
//! idem-http does). The tenant is by default a digest of the
//! `authorization` metadata ([`tenant_from_credentials`](IdempotencyLayer::tenant_from_credentials),
//! [`tenant_from_metadata`](IdempotencyLayer::tenant_from_metadata),
//! [`tenant`](IdempotencyLayer::tenant), [`shared_keys`](IdempotencyLayer::shared_keys)).
//!
//! **What is stored.** The response headers (initial metadata, without
//! `date` and `content-length`: a replay gets its own), the response body
//! exactly as the server framed it (length prefix and compression flag
//! included) and the trailers, as JSON with the body in base64. A reply
//! whose record would be over the runtime's `max_value_size` is not kept
//! (see [`max_response_bytes`](IdempotencyLayer::max_response_bytes)). A
//! trailers-only answer (an error status stored by opt-in) keeps its
//! status in the headers, as it was sent. The call that ran the handler
//! gets its answer once it is stored, so a retry sent right after it finds
//! it.
//!
//! **Waiting for the first call.** A call that would rather wait than
//! retry sends [`idem-wait: N`](IDEM_WAIT) (whole seconds, the first entry
//! counts; a value that is not whole seconds is ignored). A duplicate of a
//! call still running then waits up to `N` s, at most
//! [`max_wait`](IdempotencyLayer::max_wait) (10 s by default; zero
//! ignores the entry) and never past its own deadline (`grpc-timeout`),
//! instead of the layer's [`wait`](IdempotencyLayer::wait). Its answer is
//! the replay once the first call's answer is stored, or `ABORTED`
//! (`key-in-use`) when the wait ends first, either with
//! [`idem-wait-applied-ms`](IDEM_WAIT_APPLIED_MS), the wait granted. When
//! the first call fails (its key released), a waiting duplicate is a retry
//! like any other: one of them runs the handler, the others get its
//! answer. The wait is woken by the store (the MemoryStore in process, a
//! RedisStore by pub/sub); a store without notifications (PostgreSQL) is
//! read again, 5 ms doubling up to 250 ms apart.
//!
//! **Streaming.** Only methods you declare are protected. A declared
//! method whose request holds more than one message is refused before the
//! handler runs; one whose reply holds more than one message (it was
//! declared by mistake) streams on as it is and is recorded as processed,
//! answer not kept: a retry gets `response-not-kept`, never a second run.
//!
//! ## Tracing
//!
//! A protected call runs in an `idem.grpc` span (field `path`), the
//! parent of its `idem.call`. With feature `otel`, when the call arrives
//! under no span of the application's that carries a trace, `idem.grpc`
//! is the call's server span and continues the caller's trace from its
//! `traceparent` metadata (W3C trace context); under such a span it is an
//! internal child of it.
mod body;
pub mod client;
mod config;
mod frame;
mod layer;
mod method;
mod service;
mod stored;
mod wait;

pub use idem_key::{KeyError, MAX_KEY_LEN};
pub use idem_layer::settings::MaxLease;
pub use layer::{DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES, IdempotencyLayer};
pub use method::UnaryMethod;
pub use service::{IdempotencyService, ResponseFuture};

use http::HeaderName;

/// `idempotency-key`: the metadata entry carrying the key (the same name
/// as idem-http's header).
///
/// ```
/// assert_eq!(idem_grpc::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `idempotent-replayed: true`: initial metadata of replayed answers.
///
/// ```
/// assert_eq!(idem_grpc::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `grpc-retry-pushback-ms`: gRPC's retry pushback (gRFC A6), sent with
/// `ABORTED` (key in flight) and `UNAVAILABLE` (store down); gRPC clients
/// with a retry policy wait that long, and [`client`] honours it too.
///
/// ```
/// assert_eq!(idem_grpc::RETRY_PUSHBACK, "grpc-retry-pushback-ms");
/// ```
pub const RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// `idem-error`: on the statuses the layer answers itself, which refusal
/// it is (`key-in-use`, `key-reused`, `store-unavailable`, …, see the
/// table above).
///
/// ```
/// assert_eq!(idem_grpc::IDEM_ERROR, "idem-error");
/// ```
pub const IDEM_ERROR: HeaderName = HeaderName::from_static("idem-error");

/// `idem-wait: N`: request metadata asking that a call whose key is in
/// flight wait up to `N` whole seconds for the first call's answer
/// (capped by [`IdempotencyLayer::max_wait`] and the call's deadline)
/// instead of `ABORTED` at once.
///
/// ```
/// assert_eq!(idem_grpc::IDEM_WAIT, "idem-wait");
/// ```
pub const IDEM_WAIT: HeaderName = HeaderName::from_static("idem-wait");

/// `idem-wait-applied-ms`: on the answers to a call that sent
/// [`IDEM_WAIT`] (the replay, or `ABORTED` when the wait ran out), the
/// wait it was granted, in milliseconds.
///
/// ```
/// assert_eq!(idem_grpc::IDEM_WAIT_APPLIED_MS, "idem-wait-applied-ms");
/// ```
pub const IDEM_WAIT_APPLIED_MS: HeaderName = HeaderName::from_static("idem-wait-applied-ms");
