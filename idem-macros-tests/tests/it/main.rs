//! idem-macros's integration tests, one binary (`cargo test -p
//! idem-macros-tests --test it`): one module per topic, so `--test it ui::` runs the trybuild
//! cases (`tests/ui/`). `tests/not_installed.rs` stays its own binary:
//! installing a runtime is process-wide, and `expand` installs one.

mod expand;
mod ui;
