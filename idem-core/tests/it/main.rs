//! idem-core's integration tests, one binary (`cargo test -p idem-core --test
//! it`): one module per topic, so `--test it hook::` runs one.

mod hook;
