//! idem-postgres's integration tests, one binary (`cargo test -p
//! idem-postgres --test it`): one module per topic, so `--test it
//! partitions::` runs one.

mod support;

mod bad_input;
mod error_sources;
mod failures;
mod migrate_concurrent;
mod outbox;
mod partitions;
mod processes;
mod restart;
mod store;
mod tx;
