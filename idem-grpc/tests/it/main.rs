//! idem-grpc's integration tests, one binary (`cargo test -p idem-grpc
//! --test it`): real tonic servers on real sockets, real Redis; one module
//! per topic, so `--test it replay::` runs one.

mod support;

mod client;
mod codegen;
mod concurrency;
mod failures;
mod keys;
mod kill;
mod limits;
mod replay;
