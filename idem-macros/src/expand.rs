//! Checks the annotated function and generates its new body.

use crate::args::{self, Args, DurationArg, Errors, ScopeArg};
use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, Ident, ItemFn, Pat, ReturnType, Signature};

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
        Err(_) => {
            errors.push(not_a_function(item));
            return errors.into_result().map(|()| TokenStream::new());
        }
    };
    check_signature(&func.sig, &mut errors);
    let key = args.as_ref().and_then(|args| match &args.key {
        Some(key) => Some(key),
        None if args.key_typo => None,
        None => {
            errors.push_spanned(
                Span::call_site(),
                "#[idempotent] needs a `key`: write `#[idempotent(key = <expr>)]` with an \
                 expression over the arguments, e.g. `key = req.order_id`",
            );
            None
        }
    });
    if let (Some(args), Some(key)) = (&args, key) {
        let names = argument_names(&func.sig);
        check_names_argument(&func.sig, &names, "key", key, &mut errors);
        if let Some(fp) = &args.fingerprint {
            for part in tuple_parts(fp) {
                check_names_argument(&func.sig, &names, "fingerprint", part, &mut errors);
            }
        }
    }
    errors.into_result()?;
    match args {
        Some(args) => generate(func, &args, &krate()),
        // Unparsable arguments always leave an error, so this is not reached.
        None => Err(syn::Error::new(
            Span::call_site(),
            "#[idempotent]: invalid arguments",
        )),
    }
}

/// The error for an item that is not a plain function with a body.
fn not_a_function(item: TokenStream) -> syn::Error {
    if let Ok(decl) = syn::parse2::<syn::TraitItemFn>(item.clone()) {
        if decl.default.is_none() {
            return syn::Error::new_spanned(
                decl.semi_token,
                "#[idempotent] needs a function body: put it on the `async fn` in the `impl` block, \
                 not on the trait's declaration",
            );
        }
    }
    // Point at the item's keyword (`struct`, `impl`, …), after attributes
    // and visibility.
    let span = item
        .into_iter()
        .find_map(|tt| match tt {
            TokenTree::Ident(i) if i != "pub" => Some(i.span()),
            _ => None,
        })
        .unwrap_or_else(Span::call_site);
    syn::Error::new(
        span,
        "#[idempotent] goes on an `async fn` that returns `Result<T, E>`",
    )
}

fn check_signature(sig: &Signature, errors: &mut Errors) {
    if sig.asyncness.is_none() {
        errors.push_spanned(
            sig.fn_token.span,
            format!(
                "#[idempotent] needs an `async fn`: write `async fn {}(…)`; the idempotent call \
                 talks to the store before and after running the body",
                sig.ident
            ),
        );
    }
    match &sig.output {
        ReturnType::Default => errors.push_spanned(
            sig.paren_token.span.close(),
            format!(
                "#[idempotent] functions must return `Result<T, E>`: add a return type, like \
                 `async fn {}(…) -> Result<Receipt, PaymentError>`",
                sig.ident
            ),
        ),
        ReturnType::Type(_, ty) => {
            if let Some(span) = find_impl_trait(ty.to_token_stream()) {
                errors.push_spanned(
                    span,
                    "the return type of an #[idempotent] fn can't use `impl Trait`: the stored \
                     value is deserialized into it on replay, so name a concrete type",
                );
            }
        }
    }
}

fn find_impl_trait(tokens: TokenStream) -> Option<Span> {
    tokens.into_iter().find_map(|tt| match tt {
        TokenTree::Ident(i) if i == "impl" => Some(i.span()),
        TokenTree::Group(g) => find_impl_trait(g.stream()),
        _ => None,
    })
}

/// Every name the arguments bind, `self` included, in order.
fn argument_names(sig: &Signature) -> Vec<Ident> {
    fn walk(pat: &Pat, out: &mut Vec<Ident>) {
        match pat {
            Pat::Ident(p) => {
                out.push(p.ident.clone());
                if let Some((_, sub)) = &p.subpat {
                    walk(sub, out);
                }
            }
            Pat::Tuple(p) => p.elems.iter().for_each(|p| walk(p, out)),
            Pat::TupleStruct(p) => p.elems.iter().for_each(|p| walk(p, out)),
            Pat::Struct(p) => p.fields.iter().for_each(|f| walk(&f.pat, out)),
            Pat::Slice(p) => p.elems.iter().for_each(|p| walk(p, out)),
            Pat::Reference(p) => walk(&p.pat, out),
            Pat::Paren(p) => walk(&p.pat, out),
            Pat::Type(p) => walk(&p.pat, out),
            Pat::Or(p) => p.cases.iter().take(1).for_each(|p| walk(p, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(r) => out.push(Ident::new("self", r.self_token.span)),
            FnArg::Typed(t) => walk(&t.pat, &mut out),
        }
    }
    out
}

/// The elements of a tuple or array expression (each is checked and borrowed
/// on its own), or the expression itself.
fn tuple_parts(expr: &Expr) -> Vec<&Expr> {
    match expr {
        Expr::Tuple(t) if !t.elems.is_empty() => t.elems.iter().collect(),
        Expr::Array(a) => a.elems.iter().collect(),
        Expr::Paren(p) => tuple_parts(&p.expr),
        other => vec![other],
    }
}

/// The variable an expression starts from: `req` in `&req.order.id()`.
fn leading_ident(expr: &Expr) -> Option<&Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
        Expr::Field(e) => leading_ident(&e.base),
        Expr::MethodCall(e) => leading_ident(&e.receiver),
        Expr::Index(e) => leading_ident(&e.expr),
        Expr::Reference(e) => leading_ident(&e.expr),
        Expr::Paren(e) => leading_ident(&e.expr),
        Expr::Group(e) => leading_ident(&e.expr),
        Expr::Unary(e) => leading_ident(&e.expr),
        Expr::Cast(e) => leading_ident(&e.expr),
        Expr::Try(e) => leading_ident(&e.expr),
        Expr::Await(e) => leading_ident(&e.base),
        _ => None,
    }
}

/// Only the arguments (and items) are in scope where `key` and `fingerprint`
/// are evaluated, so a lowercase name that is not an argument is a typo or a
/// local of the body. Uppercase names are consts/statics and left to rustc.
fn check_names_argument(
    sig: &Signature,
    names: &[Ident],
    what: &str,
    expr: &Expr,
    errors: &mut Errors,
) {
    let Some(ident) = leading_ident(expr) else {
        return;
    };
    let name = ident.unraw().to_string();
    let lowercase = name.starts_with(|c: char| c.is_lowercase() || c == '_');
    if !lowercase || name == "self" || names.iter().any(|n| n.unraw() == name) {
        return;
    }
    let fn_name = &sig.ident;
    let listed: Vec<String> = names.iter().map(|n| n.unraw().to_string()).collect();
    let mut msg = if listed.is_empty() {
        format!(
            "{what} `{name}` does not name an argument of `{fn_name}`, which takes no arguments"
        )
    } else {
        format!(
            "{what} `{name}` does not name an argument of `{fn_name}`; arguments are: {}",
            listed.join(", ")
        )
    };
    if let Some(best) = args::closest(&name, listed.iter().map(String::as_str)) {
        msg.push_str(&format!("; did you mean `{best}`?"));
    }
    errors.push_spanned(ident.span(), msg);
}

/// Builds the function: same attributes and signature, new body.
fn generate(func: ItemFn, args: &Args, krate: &TokenStream) -> syn::Result<TokenStream> {
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = func;
    let ReturnType::Type(_, ret) = &sig.output else {
        return Err(syn::Error::new(
            sig.ident.span(),
            "#[idempotent] functions must return `Result<T, E>`",
        ));
    };
    // `#krate::__private`, spanned on the user tokens a call is about, so a
    // failed bound underlines those tokens rather than the whole attribute.
    let private = |span: Span| respan(quote!(#krate::__private), span);
    let ret_span = ret.span();

    // Where the runtime comes from. With `using`, an owned clone, so the body
    // can still capture a `&mut self` or `self` that `using` points into.
    let (owned, source) = match &args.using {
        Some(using) => {
            let span = using.span();
            let private = private(span);
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
            let private = private(Span::call_site());
            (quote!(), quote!(#private::global()))
        }
    };

    let scope = match &args.scope {
        Some(ScopeArg::Literal(lit)) => lit.to_token_stream(),
        Some(ScopeArg::Expr(expr)) => expr.to_token_stream(),
        None => {
            let name = sig.ident.unraw().to_string();
            quote!(::core::concat!(::core::module_path!(), "::", #name))
        }
    };

    let Some(key) = args.key.as_ref() else {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[idempotent] needs a `key`: write `#[idempotent(key = <expr>)]`",
        ));
    };
    let key_span = key.span();
    let private_key = private(key_span);
    let key_ref = borrow(key);
    let mut builder = vec![quote_spanned! {key_span=>
        let __idem_call = #private_key::call(__idem, #scope, #key_ref);
    }];
    let duration = |name: &str, arg: &Option<DurationArg>| {
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
        let private = private(span);
        Some(quote_spanned! {span=>
            let __idem_call = #private::#method(__idem_call, #value);
        })
    };
    builder.extend(duration("ttl", &args.ttl));
    builder.extend(duration("lease", &args.lease));
    if let Some(fp) = &args.fingerprint {
        // Borrow each element of a tuple, so `(req.body, currency)` does not
        // move out of `req`; `&T` serializes exactly like `T`.
        let span = fp.span();
        let value_ref = match fp {
            Expr::Tuple(t) if !t.elems.is_empty() => {
                let parts = t.elems.iter().map(borrow);
                quote_spanned!(span=> &(#(#parts,)*))
            }
            Expr::Array(a) => {
                let parts = a.elems.iter().map(borrow);
                quote_spanned!(span=> &[#(#parts),*])
            }
            _ => borrow(fp),
        };
        let private = private(span);
        builder.push(quote_spanned! {span=>
            let __idem_call = #private::fingerprint(__idem_call, #value_ref);
        });
    }
    builder.extend(duration("wait", &args.wait));

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
    let run = quote!(#run_path #run_args #await_);

    Ok(quote! {
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
    })
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
