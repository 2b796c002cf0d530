//! The attribute's pipeline: parse the arguments (`args`) and the function,
//! check them against each other (`check`), generate the new function
//! (`generate`).

use crate::args::{self, Errors};
use crate::check::{self, Checked};
use crate::generate::generate;
use proc_macro2::TokenStream;
use quote::quote;
use syn::ItemFn;

/// Entry point: never fails; errors come back as `compile_error!`s followed
/// by the function exactly as written, so that its callers do not add a
/// second wave of "cannot find function" errors.
pub(crate) fn idempotent(
    attr: TokenStream,
    item: TokenStream,
    krate: impl FnOnce() -> TokenStream,
) -> TokenStream {
    match expand(attr, item.clone(), krate) {
        Ok(tokens) => tokens,
        Err(err) => {
            let errors = err.to_compile_error();
            quote!(#errors #item)
        }
    }
}

fn expand(
    attr: TokenStream,
    item: TokenStream,
    krate: impl FnOnce() -> TokenStream,
) -> syn::Result<TokenStream> {
    let checked = parse_and_check(attr, item)?;
    Ok(generate(checked, &krate()))
}

/// Parses both inputs, collecting the errors of each, and checks them.
fn parse_and_check(attr: TokenStream, item: TokenStream) -> syn::Result<Checked> {
    let mut errors = Errors::default();
    let args = match args::parse(attr, &mut errors) {
        Ok(args) => Some(args),
        Err(e) => {
            errors.push(e);
            None
        }
    };
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => return Err(errors.ending_with(check::not_a_function(item))),
    };
    check::check(func, args, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(attr: TokenStream, item: TokenStream) -> String {
        idempotent(attr, item, || quote!(::idem)).to_string()
    }

    fn errors(attr: TokenStream, item: TokenStream) -> Vec<String> {
        match expand(attr, item, || quote!(::idem)) {
            Ok(tokens) => panic!("expected errors, got {tokens}"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn keeps_the_signature_and_replaces_the_body() {
        let out = expand_str(
            quote!(key = req.order_id, ttl = "24h"),
            quote! {
                /// Charges.
                #[inline]
                pub(crate) async fn charge<'a, T: Clone>(mut req: ChargeRequest, x: impl Display + 'a) -> Result<Receipt, PaymentError>
                where
                    T: Send,
                {
                    body_marker(req)
                }
            },
        );
        let sig = "# [doc = r\" Charges.\"] # [inline] pub (crate) async fn charge < 'a , T : Clone > (mut req : ChargeRequest , x : impl Display + 'a) -> Result < Receipt , PaymentError > where T : Send ,";
        assert!(out.starts_with(sig), "{out}\n{sig}");
        assert!(out.contains(":: idem :: __private :: global ()"), "{out}");
        assert!(out.contains(":: idem :: __private :: call (__idem , :: core :: concat ! (:: core :: module_path ! () , \"::\" , \"charge\") , & req . order_id)"), "{out}");
        assert!(out.contains(":: idem :: __private :: ttl (__idem_call , :: core :: time :: Duration :: new (86400u64 , 0u32))"), "{out}");
        assert!(
            out.contains("let __idem_fake_return : Result < Receipt , PaymentError > = loop { } ;"),
            "{out}"
        );
        assert!(out.contains(":: idem :: __private :: run :: < Result < Receipt , PaymentError > , _ , _ > (__idem_call , move || async move {"), "{out}");
        assert!(out.contains("{ body_marker (req) }"), "{out}");
        for absent in [
            "__private :: lease",
            "__private :: wait",
            "__private :: fingerprint",
            "using",
        ] {
            assert!(!out.contains(absent), "{absent}: {out}");
        }
    }

    #[test]
    fn every_argument_in_order() {
        let out = expand_str(
            quote!(
                key = order_id,
                ttl = "1h",
                lease = "10s",
                scope = "payments.refund.v1",
                fingerprint = (amount, currency),
                wait = "500ms",
                using = self.idem
            ),
            quote! {
                async fn refund(&self, order_id: &str, amount: u64, currency: &str) -> Result<Refund, PaymentError> { todo!() }
            },
        );
        let owned = out
            .find("let __idem_owned = :: idem :: __private :: using (& self . idem) ;")
            .expect(&out);
        let source = out
            .find(":: idem :: __private :: installed (& __idem_owned)")
            .expect(&out);
        let call = out
            .find("call (__idem , \"payments.refund.v1\" , & order_id)")
            .expect(&out);
        let ttl = out
            .find("ttl (__idem_call , :: core :: time :: Duration :: new (3600u64 , 0u32))")
            .expect(&out);
        let lease = out
            .find("lease (__idem_call , :: core :: time :: Duration :: new (10u64 , 0u32))")
            .expect(&out);
        let fp = out
            .find("fingerprint (__idem_call , & (& amount , & currency ,))")
            .expect(&out);
        let wait = out
            .find("wait (__idem_call , :: core :: time :: Duration :: new (0u64 , 500000000u32))")
            .expect(&out);
        let run = out.find("run ::").expect(&out);
        assert!(
            owned < source
                && source < call
                && call < ttl
                && ttl < lease
                && lease < fp
                && fp < wait
                && wait < run
        );
        assert!(!out.contains("global"));
    }

    #[test]
    fn duration_and_scope_expressions_pass_through() {
        let out = expand_str(
            quote!(
                key = id,
                ttl = Duration::from_secs(60),
                lease = LEASE,
                wait = self.wait,
                scope = SCOPE,
                fingerprint = body
            ),
            quote!(
                async fn f(&self, id: u64, body: String) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("ttl (__idem_call , Duration :: from_secs (60))"),
            "{out}"
        );
        assert!(out.contains("lease (__idem_call , LEASE)"), "{out}");
        assert!(out.contains("wait (__idem_call , self . wait)"), "{out}");
        assert!(out.contains("call (__idem , SCOPE , & id)"), "{out}");
        assert!(out.contains("fingerprint (__idem_call , & body)"), "{out}");
        let out = expand_str(
            quote!(key = id, fingerprint = amount + 1),
            quote!(
                async fn f(id: u64, amount: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("fingerprint (__idem_call , & (amount + 1))"),
            "{out}"
        );
    }

    #[test]
    fn version_and_its_rule_pass_through_typed_by_the_return_type() {
        let out = expand_str(
            quote!(
                key = id,
                version = 2,
                on_other_version = VersionRule::Reject
            ),
            quote!(
                async fn f(id: u64) -> Result<Receipt, E> {
                    todo!()
                }
            ),
        );
        assert!(out.contains("result_version (__idem_call , 2)"), "{out}");
        assert!(
            out.contains(
                "on_other_version :: < Result < Receipt , E > > (__idem_call , VersionRule :: Reject)"
            ),
            "{out}"
        );
        let out = expand_str(
            quote!(key = id, version = VERSION),
            quote!(
                async fn f(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("result_version (__idem_call , VERSION)"),
            "{out}"
        );
        assert!(!out.contains("on_other_version"), "{out}");
    }

    #[test]
    fn a_version_literal_must_fit_a_u32() {
        let item = quote!(
            async fn f(id: u64) -> Result<(), E> {
                Ok(())
            }
        );
        // (`-1` is an expression, not a literal: rustc refuses it as a `u32`.)
        for bad in [quote!(4294967296), quote!("2"), quote!(1.5)] {
            let errs = errors(quote!(key = id, version = #bad), item.clone());
            assert!(
                errs.iter()
                    .any(|e| e.starts_with("`version` must be a whole number")),
                "{bad}: {errs:?}"
            );
        }
        assert!(
            expand(quote!(key = id, version = 4294967295), item, || quote!(
                ::idem
            ))
            .is_ok()
        );
    }

    #[test]
    fn array_fingerprint_is_borrowed_element_wise() {
        let out = expand_str(
            quote!(key = id, fingerprint = [a, b]),
            quote!(
                async fn f(id: u64, a: String, b: String) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("fingerprint (__idem_call , & [& a , & b])"),
            "{out}"
        );
    }

    #[test]
    fn raw_fn_name_in_default_scope() {
        let out = expand_str(
            quote!(key = id),
            quote!(
                async fn r#match(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("\"::\" , \"match\""), "{out}");
    }

    #[test]
    fn not_async() {
        let errs = errors(
            quote!(key = id),
            quote!(
                fn charge(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0].starts_with("#[idempotent] needs an `async fn`: write `async fn charge(…)`"),
            "{errs:?}"
        );
    }

    #[test]
    fn no_missing_key_error_after_a_likely_attempt_at_key() {
        let item = quote!(
            async fn f(id: u64) -> Result<(), E> {
                Ok(())
            }
        );
        for attr in [quote!(kye = id), quote!(key), quote!(id)] {
            let errs = errors(attr.clone(), item.clone());
            assert_eq!(errs.len(), 1, "{attr}: {errs:?}");
            assert!(!errs[0].contains("needs a `key`"), "{attr}: {errs:?}");
        }
        let errs = errors(quote!(timeout = "1h"), item);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[1].starts_with("#[idempotent] needs a `key`"),
            "{errs:?}"
        );
    }

    #[test]
    fn missing_key() {
        let errs = errors(
            quote!(ttl = "1h"),
            quote!(
                async fn f(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0].starts_with("#[idempotent] needs a `key`"),
            "{errs:?}"
        );
        let errs = errors(
            quote!(),
            quote!(
                async fn f(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            errs[0].starts_with("#[idempotent] needs a `key`"),
            "{errs:?}"
        );
    }

    #[test]
    fn no_return_type() {
        let errs = errors(
            quote!(key = id),
            quote!(
                async fn f(id: u64) {}
            ),
        );
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0].starts_with("#[idempotent] functions must return `Result<T, E>`"),
            "{errs:?}"
        );
    }

    #[test]
    fn impl_trait_return() {
        let errs = errors(
            quote!(key = id),
            quote!(
                async fn f(id: u64) -> Result<impl Serialize, E> {
                    Ok(1)
                }
            ),
        );
        assert!(errs[0].contains("can't use `impl Trait`"), "{errs:?}");
    }

    #[test]
    fn key_naming_no_argument() {
        let item = quote!(
            async fn refund(&self, order_id: &str, amount: u64) -> Result<(), E> {
                Ok(())
            }
        );
        let errs = errors(quote!(key = ordr_id), item.clone());
        assert_eq!(
            errs,
            [
                "key `ordr_id` does not name an argument of `refund`; arguments are: self, order_id, amount; did you mean `order_id`?"
            ]
        );
        let errs = errors(quote!(key = request.id.to_string()), item.clone());
        assert!(
            errs[0].starts_with("key `request` does not name an argument"),
            "{errs:?}"
        );
        let errs = errors(
            quote!(key = id, fingerprint = (amount, currency)),
            item.clone(),
        );
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[1].starts_with("fingerprint `currency` does not name an argument"),
            "{errs:?}"
        );
        let errs = errors(
            quote!(key = x),
            quote!(
                async fn f() -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert_eq!(
            errs,
            ["key `x` does not name an argument of `f`, which takes no arguments"]
        );
    }

    #[test]
    fn key_names_that_are_fine() {
        let item = quote! {
            async fn f(&self, (a, mut b): (u8, u8), Point { x, y: ref yy }: Point, r#type: u8) -> Result<(), E> { Ok(()) }
        };
        for key in [
            quote!(self.id),
            quote!(a),
            quote!(b.to_string()),
            quote!(&x),
            quote!(yy),
            quote!(r#type),
            quote!(KEY_PREFIX),
            quote!(format!("{a}")),
            quote!(compute(a)),
            quote!(crate::KEY),
            quote!(*a as u64),
        ] {
            let tokens = expand(quote!(key = #key), item.clone(), || quote!(::idem));
            assert!(tokens.is_ok(), "{key}: {:?}", tokens.err());
        }
    }

    #[test]
    fn all_errors_at_once() {
        let errs = errors(
            quote!(kye2 = id, ttl = "0s", ttl = "1h"),
            quote!(
                fn f(id: u64) -> u32 {
                    1
                }
            ),
        );
        assert_eq!(errs.len(), 5, "{errs:#?}");
        assert!(errs[0].starts_with("unknown argument `kye2`"));
        assert!(errs[1].starts_with("`ttl` must be greater than zero"));
        assert!(errs[2].starts_with("duplicate argument `ttl`"));
        assert!(errs[3].starts_with("#[idempotent] needs an `async fn`"));
        assert!(errs[4].starts_with("#[idempotent] needs a `key`"));
    }

    #[test]
    fn errors_keep_the_function() {
        let out = expand_str(
            quote!(),
            quote!(
                async fn f() -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.starts_with(":: core :: compile_error !"), "{out}");
        assert!(
            out.ends_with("async fn f () -> Result < () , E > { Ok (()) }"),
            "{out}"
        );
    }

    #[test]
    fn not_a_function_at_all() {
        let errs = errors(
            quote!(key = id),
            quote!(
                struct S;
            ),
        );
        assert_eq!(
            errs,
            ["#[idempotent] goes on an `async fn` that returns `Result<T, E>`"]
        );
        let errs = errors(
            quote!(key = id),
            quote!(
                async fn f(&self) -> Result<(), E>;
            ),
        );
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(
            errs[0].starts_with("#[idempotent] needs a function body"),
            "{errs:?}"
        );
    }
}
