//! idem-dynamodb's integration tests, one binary (`cargo test -p
//! idem-dynamodb --test it`): one module per topic. Every test talks to the
//! local AWS endpoint over real sockets (moto's server, `cargo xtask
//! setup`; `IDEM_AWS_ENDPOINT` to use another) and makes a table of its own,
//! deleted after. The state-machine suites that run on every store
//! (`every_store!`) include DynamoStore in the root crate's `tests/it/`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod control;
mod errors;
mod exactly_once;
mod processes;
mod tokens;
mod too_large;
