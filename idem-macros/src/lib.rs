//! The `#[idempotent]` attribute of [idem](https://docs.rs/idem).
//!
//! Use it through the `idem` crate (`use idem::idempotent;`): the expansion
//! refers to `idem`'s runtime.

mod args;
mod crate_path;
mod expand;

use proc_macro::TokenStream;

/// DOCS
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into(), crate_path::runtime).into()
}
