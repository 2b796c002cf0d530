//! idem-macros's integration tests, one binary (`cargo test -p
//! idem-macros-tests --test it`): one module per topic, so `--test it ui::` runs the trybuild
//! cases (`tests/ui/`). `tests/not_installed.rs` stays its own binary:
//! installing a runtime is process-wide, and `expand` installs one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod expand;
mod ui;
