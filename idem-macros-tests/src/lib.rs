//! Nothing here but doctests: the tests of `#[idempotent]` (idem-macros)
//! are this crate's `tests/`, outside the proc-macro crate so that their
//! dev-dependencies are built once, for the target, with the rest of the
//! workspace's tests.

/// The examples of `#[idempotent]`'s documentation, run here with this
/// crate's dev-dependencies (`cargo test -p idem-macros-tests --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../idem-macros/src/idempotent.md")]
pub struct IdempotentDocs;
