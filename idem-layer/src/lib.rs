//! # idem-layer
//!
//! The plumbing of idem's server-side idempotency layers that does not
//! depend on the protocol above HTTP, shared by the HTTP layer
//! (`idem-http`, for axum and hyper) and the gRPC layer (`idem-grpc`, for
//! tonic; gRPC is HTTP/2). It is built on the `http`, `http-body` and
//! `tower-service` types alone: no axum, no tonic, so a tonic-only server
//! compiles no axum and an axum-only one no tonic.
//!
//! * [`record`]: the stored form of an exchange (status or gRPC code,
//!   headers, body, trailers) as compact JSON, the one record format of
//!   both layers, and the "processed, response not kept" marker;
//! * [`settings`]: what both layers configure alike, with the same
//!   defaults, where a request's tenant (its own key space) comes from, and
//!   the runtime call one request claims;
//! * [`task`]: the steps of one idempotent run: buffering the request,
//!   running the handler with its panics caught, going on when the request
//!   is dropped, and turning the run's result into the answer;
//! * `otel` (feature `otel`): a request's span continues the caller's
//!   trace;
//! * [`wait`]: how long a duplicate that asks to wait for an in-flight
//!   first request (`Prefer: wait=N`, `idem-wait: N`) is granted.
//!
//! Applications use `idem-http` or `idem-grpc` (or the facade's
//! `idem::http` and `idem::grpc`); this crate is for those two layers.
//! Its API follows theirs and changes with them: the workspace pins the
//! three crates to the same exact version.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

#[cfg(feature = "otel")]
pub mod otel;
pub mod record;
pub mod settings;
pub mod task;
pub mod wait;
