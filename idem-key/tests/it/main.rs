//! idem-key's integration tests, one binary (`cargo test -p idem-key --test
//! it`): one module per topic, so `--test it grammar::` runs one.

mod grammar;
