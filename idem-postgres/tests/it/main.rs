//! idem-postgres's integration tests, one binary (`cargo test -p
//! idem-postgres --test it`): one module per topic, so `--test it
//! partitions::` runs one.
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

mod bad_input;
mod error_sources;
mod failures;
mod migrate_concurrent;
mod outbox;
mod outbox_headers;
mod partitions;
mod processes;
mod restart;
mod store;
mod tx;
