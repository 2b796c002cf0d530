//! The facade's integration tests, one binary (`cargo test --test it`): one
//! module per topic, so `cargo test --test it semantics::` runs one. The
//! programs of the README and the guides stay in `tests/readme/`;
//! `tests/metrics.rs` stays its own binary (it needs features `http` and
//! `metrics`, `[[test]]` in Cargo.toml).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod acl;
mod bad_input;
mod batch;
mod call_batch;
mod cluster;
mod complete_path;
mod durability;
mod edges;
mod error_sources;
mod failures;
mod faults;
mod invalidate;
mod model;
mod orders_consumer_example;
mod orders_outbox_example;
mod outbox_redis;
mod outbox_redis_processes;
mod processes;
mod readme_consumers;
mod semantics;
mod shared_store;
mod stale_cache;
mod steps;
mod steps_processes;
mod wait;
