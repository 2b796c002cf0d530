//! idem-redis's integration tests, one binary (`cargo test -p idem-redis
//! --test it`): one module per topic, so `--test it cluster::` runs one.
//! Real redis-server processes throughout (idem-testkit spawns them);
//! `IDEM_REDIS_SERVER=/path/to/valkey-server` runs the whole suite on
//! Valkey, as `cargo xtask test`'s second pass does. The suites that run
//! every store through the facade (Redis among them) stay in the root
//! crate's `tests/it/`.
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
mod batch;
mod cluster;
mod complete_path;
mod durability;
mod edges;
mod faults;
mod invalidate;
mod outbox_redis;
mod outbox_redis_processes;
mod processes;
mod shared_store;
mod stale_cache;
mod wait;
