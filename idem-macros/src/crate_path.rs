//! Finds the path under which the runtime is reachable from the crate being
//! compiled.

use proc_macro2::{Span, TokenStream};
use proc_macro_crate::{crate_name, FoundCrate};
use quote::quote;
use syn::Ident;

/// `::idem` (or its renamed form), else `::idem_core`, else `::idem` so the
/// error names the crate the user should add.
pub(crate) fn runtime() -> TokenStream {
    match crate_name("idem") {
        Ok(FoundCrate::Itself) => itself(),
        Ok(FoundCrate::Name(name)) => absolute(&name),
        Err(_) => match crate_name("idem-core") {
            // Only idem-core itself would see `Itself` here, and it does not
            // use the macro; `::idem_core` is right for its tests/examples.
            Ok(FoundCrate::Itself) => absolute("idem_core"),
            Ok(FoundCrate::Name(name)) => absolute(&name),
            Err(_) => absolute("idem"),
        },
    }
}

/// Inside the `idem` package: `crate` for the `idem` library itself, `::idem`
/// for its integration tests, examples, benches and doctests, which are
/// separate crates that depend on it.
fn itself() -> TokenStream {
    let crate_name = std::env::var("CARGO_CRATE_NAME").ok();
    // rustdoc compiles each doctest with the library's CARGO_CRATE_NAME, but
    // a doctest is its own crate; rustdoc marks those compilations with this.
    let doctest = std::env::var_os("UNSTABLE_RUSTDOC_TEST_PATH").is_some();
    if is_the_library(crate_name.as_deref(), doctest) {
        quote!(crate)
    } else {
        absolute("idem")
    }
}

fn is_the_library(crate_name: Option<&str>, doctest: bool) -> bool {
    crate_name == Some("idem") && !doctest
}

fn absolute(name: &str) -> TokenStream {
    let ident = Ident::new(name, Span::call_site());
    quote!(::#ident)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_versus_its_other_targets() {
        assert!(is_the_library(Some("idem"), false));
        assert!(!is_the_library(Some("idem"), true), "doctests are separate crates");
        assert!(!is_the_library(Some("basic"), false), "integration test");
        assert!(!is_the_library(None, false));
    }

    #[test]
    fn absolute_paths() {
        assert_eq!(absolute("idem_core").to_string(), ":: idem_core");
    }

    #[test]
    fn finds_idem_from_the_dev_dependencies() {
        // This package dev-depends on `idem`, so that is what the macro uses
        // in its own tests.
        assert_eq!(runtime().to_string(), ":: idem");
    }
}
