//! Parsing and checking of the `#[idempotent(...)]` argument list.
//!
//! Every problem found is collected (not just the first one) so the user sees
//! all of them in one build, each spanned on the offending tokens.

use proc_macro2::{Span, TokenStream, TokenTree};
use std::time::Duration;
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

/// The argument names, in the order they are documented.
pub(crate) const ARGUMENTS: &[&str] = &[
    "key",
    "scope",
    "ttl",
    "lease",
    "wait",
    "fingerprint",
    "using",
    "version",
    "on_other_version",
];

/// Longest scope the runtime accepts, in bytes (`idem_core::MAX_KEY_LEN`,
/// defined in `idem-key`).
const MAX_SCOPE_LEN: usize = idem_key::MAX_KEY_LEN;

// The runtime's limits on a literal `ttl` and `lease`, from the crate that
// defines them for both (the runtime refuses other values with
// `Error::InvalidConfig` on every call; better to say so at compile time).
use idem_key::{MAX_LEASE, MAX_TTL, MIN_DURATION};

/// What the duration errors suggest instead.
const DURATION_FORMS: &str = "write a number with a unit, like \"500ms\", \"90s\", \"15m\", \"24h\" or \"7d\" \
     (units combine: \"1h 30m\"), or pass a `std::time::Duration` expression such as \
     `Duration::from_secs(90)`";

/// A `ttl`, `lease` or `wait` value.
#[derive(Debug)]
pub(crate) enum DurationArg {
    /// A string literal, parsed at compile time. Never zero.
    Literal { value: Duration, span: Span },
    /// Any other expression; it must have type `std::time::Duration`.
    Expr(Expr),
}

/// A `scope` value.
#[derive(Debug)]
pub(crate) enum ScopeArg {
    /// A checked string literal.
    Literal(LitStr),
    /// Any other expression; it must be a `&str`.
    Expr(Expr),
}

/// The parsed arguments. Only `key` is required; the checks for that and for
/// the relation to the function live in `check`.
#[derive(Debug, Default)]
pub(crate) struct Args {
    /// Names given so far, valid values or not, to report duplicates.
    seen: Vec<String>,
    /// An error already reported may be the user's attempt at `key` (an
    /// unknown argument close to it, a bare `key`, a positional value), so
    /// "missing `key`" would only repeat it.
    pub key_typo: bool,
    pub key: Option<Expr>,
    pub scope: Option<ScopeArg>,
    pub ttl: Option<DurationArg>,
    pub lease: Option<DurationArg>,
    pub wait: Option<DurationArg>,
    pub fingerprint: Option<Expr>,
    pub using: Option<Expr>,
    /// The result version (`Call::result_version`): a `u32` expression.
    pub version: Option<Expr>,
    /// The rule for other versions (`Call::on_other_version`): a
    /// `VersionRule` of the `Ok` type.
    pub on_other_version: Option<Expr>,
}

/// Accumulates errors the way serde_derive's `Ctxt` does.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    pub(crate) fn push_spanned(&mut self, span: Span, msg: impl std::fmt::Display) {
        self.push(syn::Error::new(span, msg));
    }

    pub(crate) fn into_result(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }

    /// Every error so far, followed by `last`.
    pub(crate) fn ending_with(self, last: syn::Error) -> syn::Error {
        match self.0 {
            Some(mut all) => {
                all.combine(last);
                all
            }
            None => last,
        }
    }
}

/// Parses the tokens inside `#[idempotent(...)]`.
///
/// Returns the arguments that could be read together with every error found.
/// A syntax error in a value expression stops the parse (there is nothing
/// sensible to recover to); everything else is collected.
pub(crate) fn parse(tokens: TokenStream, errors: &mut Errors) -> syn::Result<Args> {
    let parser = |input: ParseStream<'_>| parse_list(input, errors);
    parser.parse2(tokens)
}

fn parse_list(input: ParseStream<'_>, errors: &mut Errors) -> syn::Result<Args> {
    let mut args = Args::default();
    while !input.is_empty() {
        if input.peek(Ident::peek_any) && input.peek2(Token![=]) && !input.peek2(Token![==]) {
            let name = input.call(Ident::parse_any)?;
            input.parse::<Token![=]>()?;
            let value: Expr = input.parse()?;
            args.set(name, value, errors);
        } else {
            // Not `name = value`: report and skip to the next top-level comma.
            let start = input.span();
            let skipped = skip_to_comma(input);
            let msg = match skipped.first() {
                Some(TokenTree::Ident(ident)) if skipped.len() == 1 => {
                    let name = ident.to_string();
                    if ARGUMENTS.contains(&name.as_str()) {
                        format!(
                            "`{name}` needs a value: write `{name} = {}`",
                            example(&name)
                        )
                    } else {
                        unknown_argument(&name)
                    }
                }
                _ => "expected `name = value`, like `key = req.order_id` or `ttl = \"24h\"`"
                    .to_owned(),
            };
            if skipped.is_empty() {
                errors.push_spanned(start, msg);
            } else {
                let tokens: TokenStream = skipped.into_iter().collect();
                errors.push(syn::Error::new_spanned(tokens, msg));
            }
            args.key_typo = true;
        }
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    args.check_limits(errors);
    Ok(args)
}

/// Consumes token trees up to (not including) the next top-level `,`.
fn skip_to_comma(input: ParseStream<'_>) -> Vec<TokenTree> {
    let mut out = Vec::new();
    while !input.is_empty() && !input.peek(Token![,]) {
        match input.parse::<TokenTree>() {
            Ok(tt) => out.push(tt),
            Err(_) => break,
        }
    }
    out
}

/// A sample value for each argument, used in "write `name = …`" hints.
fn example(name: &str) -> &'static str {
    match name {
        "key" => "req.order_id",
        "scope" => "\"payments.refund.v1\"",
        "ttl" => "\"24h\"",
        "lease" => "\"30s\"",
        "wait" => "\"5s\"",
        "fingerprint" => "(amount, currency)",
        "using" => "self.idem",
        "version" => "2",
        "on_other_version" => "VersionRule::Reject",
        _ => "…",
    }
}

pub(crate) fn unknown_argument(name: &str) -> String {
    let valid = ARGUMENTS
        .iter()
        .map(|a| format!("`{a}`"))
        .collect::<Vec<_>>()
        .join(", ");
    match closest(name, ARGUMENTS.iter().copied()) {
        Some(best) => format!(
            "unknown argument `{name}`; did you mean `{best}`? #[idempotent] takes: {valid}"
        ),
        None => format!("unknown argument `{name}`; #[idempotent] takes: {valid}"),
    }
}

impl Args {
    fn set(&mut self, name: Ident, value: Expr, errors: &mut Errors) {
        let name_str = name.unraw().to_string();
        if ARGUMENTS.contains(&name_str.as_str()) {
            if self.seen.contains(&name_str) {
                errors.push_spanned(
                    name.span(),
                    format!("duplicate argument `{name_str}`: give it only once"),
                );
                return;
            }
            self.seen.push(name_str.clone());
        }
        macro_rules! once {
            ($slot:expr, $parsed:expr) => {{
                if let Some(v) = $parsed {
                    $slot = Some(v);
                }
            }};
        }
        match name_str.as_str() {
            "key" => once!(self.key, Some(value)),
            "scope" => once!(self.scope, scope_arg(value, errors)),
            "ttl" => once!(self.ttl, duration_arg(&name_str, value, errors)),
            "lease" => once!(self.lease, duration_arg(&name_str, value, errors)),
            "wait" => once!(self.wait, duration_arg(&name_str, value, errors)),
            "fingerprint" => once!(self.fingerprint, Some(value)),
            "using" => once!(self.using, Some(value)),
            "version" => once!(self.version, version_arg(value, errors)),
            "on_other_version" => once!(self.on_other_version, Some(value)),
            other => {
                self.key_typo |= closest(other, ARGUMENTS.iter().copied()) == Some("key");
                errors.push_spanned(name.span(), unknown_argument(other));
            }
        }
    }
}

impl Args {
    /// Checks literal durations against the runtime's limits and each other.
    fn check_limits(&self, errors: &mut Errors) {
        let lit = |d: &Option<DurationArg>| match d {
            Some(DurationArg::Literal { value, span }) => Some((*value, *span)),
            _ => None,
        };
        let fmt = format_duration;
        for (name, arg, max, what) in [
            ("ttl", &self.ttl, Some(MAX_TTL), "one year"),
            ("lease", &self.lease, Some(MAX_LEASE), "one day"),
            ("wait", &self.wait, None, ""),
        ] {
            let Some((value, span)) = lit(arg) else {
                continue;
            };
            if value < MIN_DURATION {
                errors.push_spanned(
                    span,
                    format!("`{name}` is {}; use at least 1ms", fmt(value)),
                );
            } else if let Some(max) = max.filter(|&max| value > max) {
                errors.push_spanned(
                    span,
                    format!(
                        "`{name}` is {}, over the {what} limit ({})",
                        fmt(value),
                        fmt(max)
                    ),
                );
            }
        }
        if let (Some((ttl, _)), Some((lease, span))) = (lit(&self.ttl), lit(&self.lease))
            && lease > ttl
            && lease <= MAX_LEASE
            && ttl >= MIN_DURATION
        {
            errors.push_spanned(
                span,
                format!(
                    "`lease` ({}) is longer than `ttl` ({}); the ttl must cover the lease, \
                         so shorten the lease or lengthen the ttl",
                    fmt(lease),
                    fmt(ttl)
                ),
            );
        }
    }
}

/// A `version` value: a literal must be a whole number that fits a `u32`;
/// any other expression must have type `u32`.
fn version_arg(value: Expr, errors: &mut Errors) -> Option<Expr> {
    let Expr::Lit(ExprLit { lit, .. }) = &value else {
        return Some(value);
    };
    let fits = match lit {
        Lit::Int(int) => int.base10_parse::<u32>().is_ok(),
        _ => false,
    };
    if fits {
        Some(value)
    } else {
        errors.push_spanned(
            lit.span(),
            "`version` must be a whole number from 0 to 4294967295 (the result type's version, \
             bumped when its stored JSON changes), like `version = 2`",
        );
        None
    }
}

fn scope_arg(value: Expr, errors: &mut Errors) -> Option<ScopeArg> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => {
            let text = s.value();
            let problem = if text.is_empty() {
                Some("`scope` is empty".to_owned())
            } else if text.len() > MAX_SCOPE_LEN {
                Some(format!(
                    "`scope` is {} bytes, over the {MAX_SCOPE_LEN}-byte limit",
                    text.len()
                ))
            } else if text.chars().any(char::is_control) {
                Some("`scope` contains a control character".to_owned())
            } else {
                None
            };
            match problem {
                Some(p) => {
                    errors.push_spanned(
                        s.span(),
                        format!("{p}; write a short, stable name such as `scope = \"payments.refund.v1\"`"),
                    );
                    None
                }
                None => Some(ScopeArg::Literal(s)),
            }
        }
        Expr::Lit(lit) => {
            errors.push_spanned(
                lit.span(),
                "`scope` must be a string, like `scope = \"payments.refund.v1\"`",
            );
            None
        }
        other => Some(ScopeArg::Expr(other)),
    }
}

fn duration_arg(name: &str, value: Expr, errors: &mut Errors) -> Option<DurationArg> {
    let lit = match value {
        Expr::Lit(ExprLit { lit, .. }) => lit,
        other => return Some(DurationArg::Expr(other)),
    };
    let span = lit.span();
    match &lit {
        Lit::Str(s) => match parse_duration(name, &s.value()) {
            Ok(value) => return Some(DurationArg::Literal { value, span }),
            Err(why) => errors.push_spanned(span, why),
        },
        Lit::Int(i) if !i.suffix().is_empty() => {
            // `ttl = 24h` lexes as the integer 24 with the suffix `h`.
            let text = i.to_string();
            errors.push_spanned(
                span,
                format!("write the duration as a string: `{name} = \"{text}\"`"),
            );
        }
        Lit::Float(f) if !f.suffix().is_empty() => {
            errors.push_spanned(span, format!("`{f}` is not a duration: {DURATION_FORMS}"));
        }
        Lit::Int(_) | Lit::Float(_) => errors.push_spanned(
            span,
            format!(
                "a bare number has no unit: write `{name} = \"{n}s\"` (or \"{n}ms\", \"{n}m\", …), \
                 or `{name} = Duration::from_secs({n})`",
                n = lit_text(&lit)
            ),
        ),
        _ => errors.push_spanned(
            span,
            format!("`{name}` is not a duration: {DURATION_FORMS}"),
        ),
    }
    None
}

/// `1d 2h 3m 4s 5ms`, zero parts left out, in the units the errors suggest
/// (humantime's own format counts months of 30.44 days).
pub(crate) fn format_duration(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        return format!("{}ns", d.as_nanos()).replace("000ns", "us");
    }
    let secs = d.as_secs();
    let parts = [
        (secs / 86_400, "d"),
        (secs / 3600 % 24, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
        (u64::from(d.subsec_millis()), "ms"),
    ];
    let text: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect();
    text.join(" ")
}

fn lit_text(lit: &Lit) -> String {
    match lit {
        Lit::Int(i) => i.base10_digits().to_owned(),
        Lit::Float(f) => f.base10_digits().to_owned(),
        _ => String::new(),
    }
}

/// Parses the humantime-style duration given for argument `name`; refuses
/// zero. The error is the whole message.
pub(crate) fn parse_duration(name: &str, text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text.trim()) {
        Ok(d) if d.is_zero() => Err(format!(
            "`{name}` must be greater than zero: {DURATION_FORMS}"
        )),
        Ok(d) => Ok(d),
        Err(e) => Err(format!(
            "invalid duration \"{text}\" for `{name}` ({e}): {DURATION_FORMS}"
        )),
    }
}

/// The candidate closest to `name` by edit distance, if it is close enough to
/// be a likely typo.
pub(crate) fn closest<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    let prefix = |c: &str| name.len() >= 3 && (c.starts_with(name) || name.starts_with(c));
    candidates
        .into_iter()
        .map(|c| (edit_distance(name, c), c))
        .filter(|&(d, c)| d <= limit || prefix(c))
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance: Levenshtein plus adjacent
/// transpositions (`kye` is one edit from `key`).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j] = distance between a[..i] and b[..j]
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse_ok(tokens: TokenStream) -> Args {
        let mut errors = Errors::default();
        let args = parse(tokens, &mut errors).expect("syntax");
        errors.into_result().expect("no errors");
        args
    }

    /// All error messages, in order.
    fn parse_err(tokens: TokenStream) -> Vec<String> {
        let mut errors = Errors::default();
        match parse(tokens, &mut errors) {
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
        let err = errors.into_result().expect_err("expected errors");
        err.into_iter().map(|e| e.to_string()).collect()
    }

    fn lit_duration(d: &Option<DurationArg>) -> Duration {
        match d {
            Some(DurationArg::Literal { value, .. }) => *value,
            other => panic!("not a literal duration: {other:?}"),
        }
    }

    #[test]
    fn parses_every_argument() {
        let args = parse_ok(quote! {
            key = order_id, ttl = "1h", lease = "10s", scope = "payments.refund.v1",
            fingerprint = (amount, currency), wait = "5s", using = self.idem,
        });
        assert!(matches!(args.key, Some(Expr::Path(_))));
        assert_eq!(lit_duration(&args.ttl), Duration::from_secs(3600));
        assert_eq!(lit_duration(&args.lease), Duration::from_secs(10));
        assert_eq!(lit_duration(&args.wait), Duration::from_secs(5));
        assert!(
            matches!(&args.scope, Some(ScopeArg::Literal(s)) if s.value() == "payments.refund.v1")
        );
        assert!(matches!(args.fingerprint, Some(Expr::Tuple(_))));
        assert!(matches!(args.using, Some(Expr::Field(_))));
    }

    #[test]
    fn empty_list_parses_to_nothing() {
        let args = parse_ok(quote! {});
        assert!(args.key.is_none() && args.ttl.is_none() && args.using.is_none());
    }

    #[test]
    fn key_takes_any_expression() {
        let args = parse_ok(quote! { key = format!("{}-{}", a.b, c), ttl = "24h" });
        assert!(matches!(args.key, Some(Expr::Macro(_))));
        let args = parse_ok(quote! { key = req.order_id });
        assert!(matches!(args.key, Some(Expr::Field(_))));
        // A comparison is an expression too, not a second `=`.
        let args = parse_ok(quote! { key = a == b });
        assert!(matches!(args.key, Some(Expr::Binary(_))));
    }

    #[test]
    fn durations_accept_expressions() {
        let args = parse_ok(quote! {
            key = k, ttl = Duration::from_secs(60), lease = LEASE, wait = self.wait
        });
        assert!(matches!(args.ttl, Some(DurationArg::Expr(Expr::Call(_)))));
        assert!(matches!(args.lease, Some(DurationArg::Expr(Expr::Path(_)))));
        assert!(matches!(args.wait, Some(DurationArg::Expr(Expr::Field(_)))));
    }

    #[test]
    fn humantime_forms() {
        for (text, want) in [
            ("500ms", Duration::from_millis(500)),
            ("90s", Duration::from_secs(90)),
            ("15m", Duration::from_secs(900)),
            ("24h", Duration::from_secs(86_400)),
            ("7d", Duration::from_secs(7 * 86_400)),
            ("1h 30m", Duration::from_secs(5400)),
            (" 2s ", Duration::from_secs(2)),
        ] {
            assert_eq!(parse_duration("ttl", text), Ok(want), "{text}");
        }
        assert!(
            parse_duration("ttl", "0s")
                .unwrap_err()
                .starts_with("`ttl` must be greater than zero: write a number")
        );
        assert!(
            parse_duration("wait", "0ms")
                .unwrap_err()
                .contains("greater than zero")
        );
        assert!(
            parse_duration("ttl", "abc")
                .unwrap_err()
                .starts_with("invalid duration \"abc\" for `ttl` (")
        );
        assert!(parse_duration("ttl", "").is_err());
        assert!(parse_duration("ttl", "10").is_err());
        assert!(parse_duration("ttl", "-5s").is_err());
    }

    #[test]
    fn bad_durations_say_what_to_write() {
        let errs = parse_err(quote! { key = k, ttl = "24 hours please" });
        assert_eq!(errs.len(), 1);
        assert!(
            errs[0].starts_with("invalid duration \"24 hours please\" for `ttl` ("),
            "{}",
            errs[0]
        );
        assert!(errs[0].contains("\"500ms\", \"90s\", \"15m\", \"24h\" or \"7d\""));
        assert!(errs[0].contains("Duration::from_secs(90)"));

        let errs = parse_err(quote! { key = k, lease = "0s" });
        assert!(
            errs[0].starts_with("`lease` must be greater than zero"),
            "{}",
            errs[0]
        );

        let errs = parse_err(quote! { key = k, ttl = 24h });
        assert_eq!(errs, ["write the duration as a string: `ttl = \"24h\"`"]);

        let errs = parse_err(quote! { key = k, wait = 5 });
        assert_eq!(
            errs,
            [
                "a bare number has no unit: write `wait = \"5s\"` (or \"5ms\", \"5m\", …), or `wait = Duration::from_secs(5)`"
            ]
        );

        let errs = parse_err(quote! { key = k, ttl = 1.5h });
        assert!(
            errs[0].starts_with("`1.5h` is not a duration: write a number"),
            "{}",
            errs[0]
        );

        let errs = parse_err(quote! { key = k, ttl = true });
        assert!(
            errs[0].starts_with("`ttl` is not a duration"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn runtime_limits_on_literals() {
        let errs = parse_err(quote! { key = k, ttl = "500us", lease = "2d", wait = "10ns" });
        assert_eq!(
            errs,
            [
                "`ttl` is 500us; use at least 1ms",
                "`lease` is 2d, over the one day limit (1d)",
                "`wait` is 10ns; use at least 1ms",
            ]
        );
        let errs = parse_err(quote! { key = k, ttl = "400d" });
        assert_eq!(errs, ["`ttl` is 400d, over the one year limit (365d)"]);
        let errs = parse_err(quote! { key = k, ttl = "10m", lease = "1h" });
        assert_eq!(
            errs,
            [
                "`lease` (1h) is longer than `ttl` (10m); the ttl must cover the lease, so shorten the lease or lengthen the ttl"
            ]
        );
        // Equal is fine, and so are the limits themselves.
        parse_ok(quote! { key = k, ttl = "1h", lease = "1h" });
        parse_ok(quote! { key = k, ttl = "365d", lease = "1d", wait = "1ms" });
        // Expressions are the runtime's to check.
        parse_ok(quote! { key = k, ttl = Duration::ZERO, lease = "1h" });
    }

    #[test]
    fn formats_durations() {
        assert_eq!(format_duration(Duration::from_secs(90)), "1m 30s");
        assert_eq!(
            format_duration(Duration::from_millis(86_400_500)),
            "1d 500ms"
        );
        assert_eq!(format_duration(Duration::from_micros(500)), "500us");
        assert_eq!(format_duration(Duration::from_nanos(10)), "10ns");
    }

    #[test]
    fn collects_all_errors() {
        let errs = parse_err(quote! {
            kye = id, ttl = "1h", ttl = "2h", wait = "0s", bogus = 1, scope = "", lease
        });
        assert_eq!(errs.len(), 6, "{errs:#?}");
        assert!(errs[0].starts_with("unknown argument `kye`; did you mean `key`?"));
        assert!(errs[0].contains("`key`, `scope`, `ttl`, `lease`, `wait`, `fingerprint`, `using`"));
        assert_eq!(errs[1], "duplicate argument `ttl`: give it only once");
        assert!(errs[2].starts_with("`wait` must be greater than zero"));
        assert!(errs[3].starts_with("unknown argument `bogus`; #[idempotent] takes:"));
        assert!(errs[4].starts_with("`scope` is empty"));
        assert_eq!(errs[5], "`lease` needs a value: write `lease = \"30s\"`");
    }

    #[test]
    fn duplicate_is_reported_even_if_the_second_value_is_valid() {
        let errs = parse_err(quote! { key = a, key = b });
        assert_eq!(errs, ["duplicate argument `key`: give it only once"]);
    }

    #[test]
    fn positional_value_is_refused() {
        let errs = parse_err(quote! { req.order_id, ttl = "1h" });
        assert_eq!(
            errs,
            ["expected `name = value`, like `key = req.order_id` or `ttl = \"24h\"`"]
        );
        let errs = parse_err(quote! { "payments" });
        assert_eq!(errs.len(), 1);
    }

    #[test]
    fn syntax_error_in_a_value_is_fatal_but_keeps_earlier_errors() {
        let errs = parse_err(quote! { bogus = 1, key = });
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert!(errs[0].starts_with("unknown argument `bogus`"));
    }

    #[test]
    fn scope_checks() {
        let errs = parse_err(quote! { key = k, scope = 42 });
        assert_eq!(
            errs,
            ["`scope` must be a string, like `scope = \"payments.refund.v1\"`"]
        );
        let long = "s".repeat(256);
        let errs = parse_err(quote! { key = k, scope = #long });
        assert!(errs[0].starts_with("`scope` is 256 bytes, over the 255-byte limit"));
        let errs = parse_err(quote! { key = k, scope = "a\nb" });
        assert!(errs[0].starts_with("`scope` contains a control character"));
        let args = parse_ok(quote! { key = k, scope = SCOPE });
        assert!(matches!(args.scope, Some(ScopeArg::Expr(_))));
    }

    #[test]
    fn raw_identifiers_are_unrawed() {
        let args = parse_ok(quote! { r#key = k });
        assert!(args.key.is_some());
    }

    #[test]
    fn suggestions() {
        assert_eq!(closest("kye", ARGUMENTS.iter().copied()), Some("key"));
        assert_eq!(
            closest("fingerprnt", ARGUMENTS.iter().copied()),
            Some("fingerprint")
        );
        assert_eq!(closest("use", ARGUMENTS.iter().copied()), None);
        assert_eq!(closest("usin", ARGUMENTS.iter().copied()), Some("using"));
        assert_eq!(
            closest("fingerprints", ARGUMENTS.iter().copied()),
            Some("fingerprint")
        );
        assert_eq!(closest("ke", ARGUMENTS.iter().copied()), Some("key"));
        assert_eq!(closest("timeout", ARGUMENTS.iter().copied()), None);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("kye", "key"), 1);
    }
}
