//! idem-http's integration tests, one binary (`cargo test -p idem-http
//! --test it`): one module per topic, so `--test it keys::` runs one.

mod support;

mod bodies;
mod end_to_end;
mod failures;
mod keys;
mod replay;
