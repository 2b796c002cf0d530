//! The `#[idempotent]` attribute of [idem](https://docs.rs/idem).
//!
//! Use it through the `idem` crate (`use idem::idempotent;`): the expansion
//! refers to `idem`'s runtime (or to `idem-core`'s, for crates that depend on
//! that instead).
#![allow(
    clippy::indexing_slicing,
    reason = "its indexing predates the workspace-wide deny and is not audited yet"
)]

mod args;
mod check;
mod crate_path;
mod expand;
mod generate;

use proc_macro::TokenStream;

// The documentation lives in idempotent.md. Its examples need `idem`,
// `serde` and `tokio`, which a proc-macro crate cannot have as
// dev-dependencies without building them (and the whole workspace under
// `idem`) a second time for the host: idem-macros-tests runs them, and
// rustdoc does not collect them here.
#[cfg_attr(not(doctest), doc = include_str!("idempotent.md"))]
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into(), crate_path::runtime).into()
}
