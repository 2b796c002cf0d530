//! idem-cli's integration tests, one binary (`cargo test -p idem-cli --test
//! it`): one module per topic, so `--test it postgres::` runs one.

mod cli;
mod postgres;
