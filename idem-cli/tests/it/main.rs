//! idem-cli's integration tests, one binary (`cargo test -p idem-cli --test
//! it`): one module per topic, so `--test it postgres::` runs one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod cli;
mod dynamodb;
mod postgres;
