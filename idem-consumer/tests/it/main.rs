//! idem-consumer's integration tests, one binary (`cargo test -p
//! idem-consumer --test it`): one module per topic, so `--test it nats::`
//! runs one broker's suite. The tracing-span test stays its own binary
//! (`tests/span.rs`): a scoped subscriber there must not share callsites
//! with tests running without one.
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

mod core;
mod kafka;
mod nats;
mod outbox_sinks;
mod rabbitmq;
mod redis_streams;
mod sqs;
