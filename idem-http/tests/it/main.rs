//! idem-http's integration tests, one binary (`cargo test -p idem-http
//! --test it`): one module per topic, so `--test it keys::` runs one.
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

mod bodies;
mod end_to_end;
mod failures;
mod keys;
#[cfg(feature = "otel")]
mod otel;
mod prefer_wait;
mod replay;
