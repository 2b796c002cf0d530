//! Finds the path under which the runtime is reachable from the crate being
//! compiled.

use proc_macro_crate::{FoundCrate, crate_name};
use proc_macro2::{Span, TokenStream};
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

/// Inside the `idem` package. Its integration tests, examples and benches
/// are crates named after the target that depend on `idem`: `::idem`. When
/// `CARGO_CRATE_NAME` is `idem`, the crate is either the library itself (where
/// `::idem` does not resolve) or one of its doctests (rustdoc compiles them
/// with the library's `CARGO_CRATE_NAME`, and with edition 2024's merged
/// doctests nothing else tells them apart, while `crate::` does not resolve
/// there). `::idem_core` resolves in both: the library depends on it, and
/// doctests get every dependency of the package.
fn itself() -> TokenStream {
    let crate_name = std::env::var("CARGO_CRATE_NAME").ok();
    match itself_path(crate_name.as_deref()) {
        "idem_core" => match crate_name_of("idem-core") {
            Some(name) => absolute(&name),
            None => absolute("idem_core"),
        },
        other => absolute(other),
    }
}

/// The name under which the package being compiled depends on `package`.
fn crate_name_of(package: &str) -> Option<String> {
    match crate_name(package) {
        Ok(FoundCrate::Name(name)) => Some(name),
        _ => None,
    }
}

fn itself_path(crate_name: Option<&str>) -> &'static str {
    if crate_name == Some("idem") {
        "idem_core"
    } else {
        "idem"
    }
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
        assert_eq!(
            itself_path(Some("idem")),
            "idem_core",
            "the library or its doctests"
        );
        assert_eq!(
            itself_path(Some("basic")),
            "idem",
            "an integration test or example"
        );
        assert_eq!(itself_path(None), "idem", "not built by cargo");
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
