//! idem-testkit's integration tests, one binary (`cargo test -p idem-testkit
//! --test it`): one module per topic, so `--test it proxy::` runs one.

mod cluster;
mod proxy;
mod server;
