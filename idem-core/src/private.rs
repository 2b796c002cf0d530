//! Support for the code that `#[idempotent]` generates. Not a public API:
//! reached as `idem::__private`, and may change in any release.
//!
//! Every call the expansion makes into the runtime goes through here, so that
//! - each way of misusing the macro fails one `#[diagnostic::on_unimplemented]`
//!   bound with a message about the attribute, spanned (by the macro) on the
//!   user's own tokens, instead of a bound deep inside `Call::run`;
//! - the macro depends on this file only, not on the shape of `Call`.

use crate::{Call, Error, Idempotency, VersionRule};
use futures_util::FutureExt;
use futures_util::future::{Either, ready};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

/// Implemented only for `Result<T, E>`: the declared return type of an
/// `#[idempotent]` fn.
#[diagnostic::on_unimplemented(
    message = "#[idempotent] functions must return `Result<T, E>`, not `{Self}`",
    label = "not a `Result`",
    note = "the `Ok` value is stored and replayed to later calls with the same key, and idempotency failures are returned as the `Err` value",
    note = "a type alias of `Result` works too"
)]
pub trait IdempotentResult: Sized {
    /// `T`.
    type Ok;
    /// `E`.
    type Err;
    /// Splits `Self` into a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
    /// Builds `Self` from a `Result`.
    fn from_result(result: Result<Self::Ok, Self::Err>) -> Self;
}

impl<T, E> IdempotentResult for Result<T, E> {
    type Ok = T;
    type Err = E;

    #[inline]
    fn into_result(self) -> Result<T, E> {
        self
    }

    #[inline]
    fn from_result(result: Result<T, E>) -> Self {
        result
    }
}

/// The `Ok` type of an `#[idempotent]` fn: stored, then replayed.
#[diagnostic::on_unimplemented(
    message = "the `Ok` value of an #[idempotent] fn must implement `Serialize` and `DeserializeOwned`; `{Self}` does not",
    label = "stored on success and deserialized on replay",
    note = "derive both: `#[derive(serde::Serialize, serde::Deserialize)]`"
)]
pub trait Storable: Serialize + DeserializeOwned {}

impl<T: Serialize + DeserializeOwned> Storable for T {}

/// The `Err` type of an `#[idempotent]` fn.
#[diagnostic::on_unimplemented(
    message = "the error type of an #[idempotent] fn must implement `From<idem::Error>`; `{Self}` does not",
    label = "idempotency failures (store down, key in progress, …) are returned as this type",
    note = "add a variant for them, e.g. `Idem(#[from] idem::Error)` with thiserror, or write `impl From<idem::Error> for {Self}`"
)]
pub trait IdemError: From<Error> {}

impl<E: From<Error>> IdemError for E {}

/// The type of `key = <expr>`.
#[diagnostic::on_unimplemented(
    message = "the idempotency key must implement `std::fmt::Display`; `{Self}` does not",
    label = "the key is rendered to text with `Display`",
    note = "use a field or method that is a string or a number, or `format!` the parts: `key = format!(\"{{}}-{{}}\", a, b)`"
)]
pub trait Key: Display {}

impl<K: Display + ?Sized> Key for K {}

/// The type of `fingerprint = <expr>`.
#[diagnostic::on_unimplemented(
    message = "the `fingerprint` value must implement `serde::Serialize`; `{Self}` does not",
    label = "hashed to tell a retry from a different request that reuses the key",
    note = "fingerprint the request fields that matter (`fingerprint = (amount, currency)`), or derive `serde::Serialize`"
)]
pub trait FingerprintValue: Serialize {}

impl<F: Serialize + ?Sized> FingerprintValue for F {}

/// The type of `using = <expr>`.
#[diagnostic::on_unimplemented(
    message = "`using` must be an `Idempotency` or a reference to one, not `{Self}`",
    label = "the `Idempotency` to run this call with",
    note = "e.g. `using = self.idem` where the field is an `idem::Idempotency`; without `using`, the one installed with `.install()` is used"
)]
pub trait AsIdempotency {
    /// Borrows the `Idempotency`.
    fn as_idempotency(&self) -> &Idempotency;
}

impl AsIdempotency for Idempotency {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        self
    }
}

impl<T: AsIdempotency + ?Sized> AsIdempotency for &T {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        (**self).as_idempotency()
    }
}

impl<T: AsIdempotency + ?Sized> AsIdempotency for &mut T {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        (**self).as_idempotency()
    }
}

impl<T: AsIdempotency + ?Sized> AsIdempotency for Box<T> {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        (**self).as_idempotency()
    }
}

impl<T: AsIdempotency + ?Sized> AsIdempotency for std::sync::Arc<T> {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        (**self).as_idempotency()
    }
}

impl<T: AsIdempotency + ?Sized> AsIdempotency for std::rc::Rc<T> {
    #[inline]
    fn as_idempotency(&self) -> &Idempotency {
        (**self).as_idempotency()
    }
}

/// The installed default, or `Error::NotInstalled`.
#[inline]
pub fn global() -> Result<&'static Idempotency, Error> {
    Idempotency::global().ok_or(Error::NotInstalled)
}

/// An owned handle from `using = <expr>`, so the call does not borrow
/// whatever the expression points into (often `self`).
#[inline]
pub fn using<U: AsIdempotency + ?Sized>(using: &U) -> Idempotency {
    using.as_idempotency().clone()
}

/// The handle from `using`, in the shape `global` returns.
#[inline]
pub fn installed(idem: &Idempotency) -> Result<&Idempotency, Error> {
    Ok(idem)
}

/// `idem.call(scope, key)`.
#[inline]
pub fn call<'a, K: Key + ?Sized>(idem: &'a Idempotency, scope: &'a str, key: &K) -> Call<'a> {
    idem.call(scope, key)
}

/// `call.ttl(d)`.
#[inline]
pub fn ttl(call: Call<'_>, d: Duration) -> Call<'_> {
    call.ttl(d)
}

/// `call.lease(d)`.
#[inline]
pub fn lease(call: Call<'_>, d: Duration) -> Call<'_> {
    call.lease(d)
}

/// `call.wait(d)`.
#[inline]
pub fn wait(call: Call<'_>, d: Duration) -> Call<'_> {
    call.wait(d)
}

/// `call.fingerprint(value)`.
#[inline]
pub fn fingerprint<'a, F: FingerprintValue + ?Sized>(call: Call<'a>, value: &F) -> Call<'a> {
    call.fingerprint(value)
}

/// `call.result_version(version)`.
#[inline]
pub fn result_version(call: Call<'_>, version: u32) -> Call<'_> {
    call.result_version(version)
}

/// `call.on_other_version(rule)`, the rule of the declared return type
/// `R`'s `Ok` type.
#[inline]
pub fn on_other_version<R>(call: Call<'_>, rule: VersionRule<R::Ok>) -> Call<'_>
where
    R: IdempotentResult,
    R::Ok: Storable + 'static,
{
    call.on_other_version(rule)
}

/// Runs the body through `call`, or returns the error that kept `call` from
/// being made (no runtime installed) without running it.
///
/// `R` is the declared return type. Its bounds are stated on `R`'s `Ok` and
/// `Err` types rather than on separate type parameters, so that every failed
/// bound is reported once, on the span the macro gives this call.
pub fn run<R, F, Fut>(call: Result<Call<'_>, Error>, body: F) -> impl Future<Output = R>
where
    R: IdempotentResult,
    R::Ok: Storable,
    R::Err: IdemError,
    F: FnOnce() -> Fut,
    Fut: Future<Output = R>,
{
    // The call's future mapped, not awaited inside one of this function's
    // own (which would hold it beside the call and copy it in whole).
    match call {
        Ok(call) => Either::Left(
            call.run(move || async move { body().await.into_result() })
                .map(R::from_result),
        ),
        Err(err) => Either::Right(ready(R::from_result(Err(<R::Err>::from(err))))),
    }
}
