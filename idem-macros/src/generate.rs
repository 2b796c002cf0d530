//! Generates the new body of a [`Checked`] function: the idempotent call
//! built from the arguments, around the original body.

use crate::args::{Args, DurationArg, ScopeArg};
use crate::check::Checked;
use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Block, Expr, Ident, ItemFn, Signature, Type};

/// Builds the function: same attributes and signature, new body.
pub(crate) fn generate(checked: Checked, krate: &TokenStream) -> TokenStream {
    let Checked {
        func:
            ItemFn {
                attrs,
                vis,
                sig,
                block,
            },
        args,
        key,
        ret,
    } = checked;
    let (owned, source) = runtime(args.using.as_ref(), krate);
    let builder = call_builder(&sig, &args, &key, &ret, krate);
    let run = run(&ret, &block, krate);
    quote! {
        #(#attrs)*
        #vis #sig {
            #owned
            let __idem_call = match #source {
                ::core::result::Result::Ok(__idem) => {
                    #(#builder)*
                    ::core::result::Result::Ok(__idem_call)
                }
                ::core::result::Result::Err(__idem_err) => ::core::result::Result::Err(__idem_err),
            };
            #run
        }
    }
}

/// `#krate::__private`, spanned on the user tokens a call is about, so a
/// failed bound underlines those tokens rather than the whole attribute.
fn private(krate: &TokenStream, span: Span) -> TokenStream {
    respan(quote!(#krate::__private), span)
}

/// Where the runtime comes from: the statements before the call, and the
/// expression that gives it. With `using`, an owned clone, so the body can
/// still capture a `&mut self` or `self` that `using` points into.
fn runtime(using: Option<&Expr>, krate: &TokenStream) -> (TokenStream, TokenStream) {
    match using {
        Some(using) => {
            let span = using.span();
            let private = private(krate, span);
            let using_ref = borrow(using);
            let owned = quote_spanned! {span=>
                let __idem_owned = #private::using(#using_ref);
            };
            (
                owned,
                quote_spanned!(span=> #private::installed(&__idem_owned)),
            )
        }
        None => {
            let private = private(krate, Span::call_site());
            (quote!(), quote!(#private::global()))
        }
    }
}

/// The scope: the argument, or the function's path.
fn scope(args: &Args, sig: &Signature) -> TokenStream {
    match &args.scope {
        Some(ScopeArg::Literal(lit)) => lit.to_token_stream(),
        Some(ScopeArg::Expr(expr)) => expr.to_token_stream(),
        None => {
            let name = sig.ident.unraw().to_string();
            quote!(::core::concat!(::core::module_path!(), "::", #name))
        }
    }
}

/// The statements that build `__idem_call` from `__idem`, one per argument
/// given, in the order the builder applies them.
fn call_builder(
    sig: &Signature,
    args: &Args,
    key: &Expr,
    ret: &Type,
    krate: &TokenStream,
) -> Vec<TokenStream> {
    let scope = scope(args, sig);
    let key_span = key.span();
    let private_key = private(krate, key_span);
    let key_ref = borrow(key);
    let mut builder = vec![quote_spanned! {key_span=>
        let __idem_call = #private_key::call(__idem, #scope, #key_ref);
    }];
    builder.extend(duration("ttl", &args.ttl, krate));
    builder.extend(duration("lease", &args.lease, krate));
    if let Some(fp) = &args.fingerprint {
        let span = fp.span();
        let value_ref = fingerprint_ref(fp);
        let private = private(krate, span);
        builder.push(quote_spanned! {span=>
            let __idem_call = #private::fingerprint(__idem_call, #value_ref);
        });
    }
    builder.extend(duration("wait", &args.wait, krate));
    if let Some(version) = &args.version {
        let span = version.span();
        let private = private(krate, span);
        builder.push(quote_spanned! {span=>
            let __idem_call = #private::result_version(__idem_call, #version);
        });
    }
    if let Some(rule) = &args.on_other_version {
        let span = rule.span();
        let private = private(krate, span);
        // The rule's type is the declared `Ok` type: `VersionRule::Reject`
        // needs no annotation.
        builder.push(quote_spanned! {span=>
            let __idem_call = #private::on_other_version::<#ret>(__idem_call, #rule);
        });
    }
    builder
}

/// The statement that sets duration `name`, if given.
fn duration(name: &str, arg: &Option<DurationArg>, krate: &TokenStream) -> Option<TokenStream> {
    let arg = arg.as_ref()?;
    let (span, value) = match arg {
        DurationArg::Literal { value, span } => {
            let secs = proc_macro2::Literal::u64_suffixed(value.as_secs());
            let nanos = proc_macro2::Literal::u32_suffixed(value.subsec_nanos());
            (
                *span,
                quote_spanned!(*span=> ::core::time::Duration::new(#secs, #nanos)),
            )
        }
        DurationArg::Expr(expr) => (expr.span(), expr.to_token_stream()),
    };
    let method = Ident::new(name, span);
    let private = private(krate, span);
    Some(quote_spanned! {span=>
        let __idem_call = #private::#method(__idem_call, #value);
    })
}

/// A reference to the fingerprint value. Each element of a tuple or array is
/// borrowed on its own, so `(req.body, currency)` does not move out of
/// `req`; `&T` serializes exactly like `T`.
fn fingerprint_ref(fp: &Expr) -> TokenStream {
    let span = fp.span();
    match fp {
        Expr::Tuple(t) if !t.elems.is_empty() => {
            let parts = t.elems.iter().map(borrow);
            quote_spanned!(span=> &(#(#parts,)*))
        }
        Expr::Array(a) => {
            let parts = a.elems.iter().map(borrow);
            quote_spanned!(span=> &[#(#parts),*])
        }
        _ => borrow(fp),
    }
}

/// The call of `run` with the original body, awaited.
fn run(ret: &Type, block: &Block, krate: &TokenStream) -> TokenStream {
    let ret_span = ret.span();
    // The body runs inside `async move`, so `return` and `?` leave that block;
    // the never-taken fake return pins its type to the declared return type,
    // which keeps type errors on the user's own tokens (as tracing's
    // `#[instrument]` does).
    let fake_return = quote_spanned! {ret_span=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let __idem_fake_return: #ret = loop {};
            return __idem_fake_return;
        }
    };
    // Every bound about the result (a `T` that is not `Serialize`, an `E`
    // without `From<idem::Error>`, a type that is not a `Result`) fails on the
    // path to `run`, on the call, and on its `.await`. All three get the same
    // span, the return type's, so rustc reports each failure once, with the
    // message of `__private`'s traits.
    let run_path = respan(quote!(#krate::__private::run::<#ret, _, _>), ret_span);
    let mut run_args = proc_macro2::Group::new(
        proc_macro2::Delimiter::Parenthesis,
        quote! {
            __idem_call,
            move || async move {
                #fake_return
                #block
            }
        },
    );
    run_args.set_span(ret_span);
    let await_ = quote_spanned!(ret_span=> .await);
    quote!(#run_path #run_args #await_)
}

/// `&expr`, parenthesized only where precedence needs it. Without the
/// parentheses, rustc's span for the argument runs from `&` (given the
/// expression's first span) to the expression's last token, so a failed
/// bound underlines the whole expression, not just its first token.
fn borrow(expr: &Expr) -> TokenStream {
    let span = expr.span();
    match expr {
        Expr::Path(_)
        | Expr::Field(_)
        | Expr::MethodCall(_)
        | Expr::Call(_)
        | Expr::Index(_)
        | Expr::Macro(_)
        | Expr::Lit(_)
        | Expr::Paren(_)
        | Expr::Tuple(_)
        | Expr::Array(_)
        | Expr::Reference(_)
        | Expr::Unary(_)
        | Expr::Try(_)
        | Expr::Await(_) => quote_spanned!(span=> &#expr),
        _ => quote_spanned!(span=> &(#expr)),
    }
}

/// `tokens` with every span replaced by `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tt| {
            if let TokenTree::Group(g) = &tt {
                let mut group = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                group.set_span(span);
                tt = TokenTree::Group(group);
            } else {
                tt.set_span(span);
            }
            tt
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrows_keep_precedence() {
        let cases = [
            (quote!(a.b), "& a . b"),
            (quote!(f(x)), "& f (x)"),
            (quote!(format!("{a}")), "& format ! (\"{a}\")"),
            (quote!(a + b), "& (a + b)"),
            (quote!(x as u64), "& (x as u64)"),
            (quote!(*x), "& * x"),
            (quote!(if c { a } else { b }), "& (if c { a } else { b })"),
        ];
        for (expr, want) in cases {
            let expr: Expr = syn::parse2(expr).unwrap();
            assert_eq!(borrow(&expr).to_string(), want);
        }
    }
}
