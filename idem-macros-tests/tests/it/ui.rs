//! Compile-time behaviour of `#[idempotent]`: what must build (and run), and
//! the exact diagnostics for each misuse (`tests/ui/fail/*.stderr`).
//!
//! After changing a message on purpose, regenerate the `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p idem-macros-tests --test it ui::` and read the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
