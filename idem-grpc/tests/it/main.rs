//! idem-grpc's integration tests, one binary (`cargo test -p idem-grpc
//! --test it`): real tonic servers on real sockets, real Redis; one module
//! per topic, so `--test it replay::` runs one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod support;

mod client;
mod codegen;
mod concurrency;
mod failures;
mod keys;
mod kill;
mod limits;
#[cfg(feature = "otel")]
mod otel;
mod replay;
mod wait;
