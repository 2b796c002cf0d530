//! The facade's integration tests, one binary (`cargo test --test it`): one
//! module per topic, so `cargo test --test it semantics::` runs one. The
//! programs of the README and the guides stay in `tests/readme/`;
//! `tests/metrics.rs` stays its own binary (it needs features `http` and
//! `metrics`, `[[test]]` in Cargo.toml). Here: the suites that run every
//! store through the facade (memory, Redis, PostgreSQL) and the examples;
//! the Redis store's own suites are idem-redis's (`idem-redis/tests/it/`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod bad_input;
mod call_batch;
mod error_sources;
mod failures;
mod model;
mod operate;
mod orders_consumer_example;
mod orders_outbox_example;
#[cfg(feature = "otel")]
mod otel_trace;
mod readme_consumers;
mod result_versions;
mod semantics;
mod steps;
mod steps_processes;
