//! Checks the annotated function and the arguments against each other, and
//! turns what passed into a [`Checked`] expansion for `generate`.
//!
//! Every problem found is collected (not just the first one) so the user sees
//! all of them in one build, each spanned on the offending tokens.

use crate::args::{self, Args, Errors};
use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{Expr, FnArg, Ident, ItemFn, Pat, ReturnType, Signature, Type};

/// A function and arguments that passed every check, with what `generate`
/// relies on taken out of its `Option`s.
pub(crate) struct Checked {
    pub(crate) func: ItemFn,
    pub(crate) args: Args,
    /// The `key` argument (required).
    pub(crate) key: Expr,
    /// The declared return type (an `async fn` without one is refused).
    pub(crate) ret: Box<Type>,
}

/// Checks `func` and `args` (`None`: they did not parse; `errors` says why)
/// and returns every error found, or the checked expansion.
pub(crate) fn check(func: ItemFn, args: Option<Args>, mut errors: Errors) -> syn::Result<Checked> {
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
    // Without errors, the arguments parsed, `key` was given and the function
    // has a return type; the checks above say so otherwise.
    let ret = match &func.sig.output {
        ReturnType::Type(_, ret) => Some(ret.clone()),
        ReturnType::Default => None,
    };
    match (args, ret) {
        (Some(mut args), Some(ret)) => match args.key.take() {
            Some(key) => Ok(Checked {
                func,
                args,
                key,
                ret,
            }),
            None => Err(invalid()),
        },
        _ => Err(invalid()),
    }
}

/// The error for a combination the checks rule out: never shown, but an
/// error is better than a panic in the compiler.
fn invalid() -> syn::Error {
    syn::Error::new(Span::call_site(), "#[idempotent]: invalid arguments")
}

/// The error for an item that is not a plain function with a body.
pub(crate) fn not_a_function(item: TokenStream) -> syn::Error {
    if let Ok(decl) = syn::parse2::<syn::TraitItemFn>(item.clone())
        && decl.default.is_none()
    {
        return syn::Error::new_spanned(
            decl.semi_token,
            "#[idempotent] needs a function body: put it on the `async fn` in the `impl` block, \
                 not on the trait's declaration",
        );
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
