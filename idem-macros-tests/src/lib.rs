//! Nothing here: the tests of `#[idempotent]` (idem-macros) are this
//! crate's `tests/`, outside the proc-macro crate so that their
//! dev-dependencies are built once, for the target, with the rest of the
//! workspace's tests.
