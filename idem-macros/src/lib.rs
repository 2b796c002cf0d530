//! The `#[idempotent]` attribute of [idem](https://docs.rs/idem).
//!
//! Use it through the `idem` crate (`use idem::idempotent;`): the expansion
//! refers to `idem`'s runtime (or to `idem-core`'s, for crates that depend on
//! that instead).

mod args;
mod check;
mod crate_path;
mod expand;
mod generate;

use proc_macro::TokenStream;

/// Makes an `async fn` run its body at most once per idempotency key; later
/// calls with the same key get the stored `Ok` value back without running it.
///
/// ```
/// use idem::{idempotent, Idempotency, MemoryStore};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// pub struct Receipt { pub order_id: String, pub amount: u64 }
///
/// pub struct ChargeRequest { pub order_id: String, pub amount: u64 }
///
/// #[derive(Debug)]
/// pub enum PaymentError { Idem(idem::Error), Declined }
///
/// impl From<idem::Error> for PaymentError {
///     fn from(e: idem::Error) -> Self { PaymentError::Idem(e) }
/// }
///
/// #[idempotent(key = req.order_id, ttl = "24h")]
/// async fn charge(req: ChargeRequest) -> Result<Receipt, PaymentError> {
///     // … call the payment provider: this runs once per order_id …
///     Ok(Receipt { order_id: req.order_id, amount: req.amount })
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem::Error> {
/// // At startup, install the process-wide default (here in memory; use
/// // `RedisStore` to share it between processes).
/// Idempotency::builder(MemoryStore::new()).build().install()?;
///
/// let req = || ChargeRequest { order_id: "order-1".into(), amount: 500 };
/// let first = charge(req()).await.unwrap();
/// let retry = charge(req()).await.unwrap(); // replayed: the body did not run
/// assert_eq!(first, retry);
/// # Ok(())
/// # }
/// ```
///
/// # Arguments
///
/// | argument | value | default |
/// | --- | --- | --- |
/// | `key = <expr>` | **required.** Any expression over the arguments whose value is `Display`: `req.order_id`, `format!("{user}:{n}")` | |
/// | `scope = "…"` | names the operation; keys of different scopes never meet | `concat!(module_path!(), "::", "<fn name>")` |
/// | `ttl = …` | how long the result is replayed | the `Idempotency`'s `result_ttl` |
/// | `lease = …` | how long a running body holds the key before another call may take over | the `Idempotency`'s `lease` |
/// | `wait = …` | when another call is running the body, wait this long for its result instead of failing at once with `Error::InProgress` | the `Idempotency`'s `wait` |
/// | `fingerprint = <expr>` | any `Serialize` value, usually the request payload; reusing a key with a different fingerprint fails with `Error::FingerprintMismatch` | none |
/// | `using = <expr>` | the `Idempotency` to use: an `Idempotency`, a reference to one, or an `Arc`/`Box` of one | the one installed with `Idempotency::install` |
///
/// `ttl`, `lease` and `wait` take either a string literal, checked at
/// compile time (`"500ms"`, `"90s"`, `"15m"`, `"24h"`, `"7d"`, or combined:
/// `"1h 30m"`; zero, or a `ttl`/`lease` outside what the runtime accepts, is
/// a compile error), or any expression of type `std::time::Duration`:
///
/// ```
/// # use idem::{idempotent, Idempotency, MemoryStore};
/// # use serde::{Deserialize, Serialize};
/// use std::time::Duration;
///
/// # #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// # pub struct Refund { pub amount: u64 }
/// # #[derive(Debug)]
/// # pub struct PaymentError(idem::Error);
/// # impl From<idem::Error> for PaymentError {
/// #     fn from(e: idem::Error) -> Self { PaymentError(e) }
/// # }
/// const REFUND_LEASE: Duration = Duration::from_secs(10);
///
/// pub struct Payments {
///     idem: Idempotency,
///     wait: Duration,
/// }
///
/// impl Payments {
///     #[idempotent(key = order_id, ttl = "1h", lease = REFUND_LEASE, wait = self.wait,
///                  scope = "payments.refund.v1", fingerprint = (amount, currency),
///                  using = self.idem)]
///     pub async fn refund(&self, order_id: &str, amount: u64, currency: &str)
///         -> Result<Refund, PaymentError>
///     {
///         Ok(Refund { amount })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let payments = Payments {
///     idem: Idempotency::builder(MemoryStore::new()).build(),
///     wait: Duration::from_secs(5),
/// };
/// assert_eq!(payments.refund("order-9", 500, "EUR").await.unwrap(), Refund { amount: 500 });
/// // Same key, different payload: refused rather than replaying another request's result.
/// assert!(matches!(
///     payments.refund("order-9", 700, "EUR").await,
///     Err(PaymentError(idem::Error::FingerprintMismatch))
/// ));
/// # }
/// ```
///
/// # The function
///
/// - It must be an `async fn` returning `Result<T, E>` (or an alias of it):
///   `T` is stored, so it must be `Serialize + DeserializeOwned`; `E` receives
///   idempotency failures (store unavailable, key in progress, fingerprint
///   mismatch, no runtime installed, …), so it must implement
///   `From<idem::Error>`. An `Err` returned by the body is not stored: the
///   key is released and the next call runs the body again.
/// - The signature is kept exactly as written: visibility, generics, `where`
///   clauses, lifetimes, `impl Trait` arguments, `self`, `&self` and
///   `&mut self` receivers, `mut` patterns, other attributes and doc comments.
///   `return` and `?` in the body work as usual.
/// - `key`, `fingerprint` and `using` are evaluated first, before the body
///   takes ownership of the arguments; they only borrow them (a
///   `fingerprint` tuple borrows each element), and `using` is cloned (a
///   cheap `Arc` clone), so a `&mut self` body can still use `self`.
/// - Without `using`, a call when no runtime is installed returns
///   `Err(E::from(idem::Error::NotInstalled))` without running the body; it
///   never panics.
///
/// # Scopes
///
/// The stored key is `namespace:scope:key`. The default scope is the
/// function's path, `concat!(module_path!(), "::", "<fn name>")`, e.g.
/// `my_app::payments::charge`. It is stable as long as the module path and
/// the function name do not change; renaming or moving the function starts
/// a fresh key space, so set `scope` explicitly for operations whose keys
/// must survive refactoring. Methods are not qualified by their type: two
/// types in the same module with a method of the same name share a default
/// scope, so at least one of them must set `scope`. Use a string literal (or
/// a `&'static str` constant) for `scope`.
///
/// # Errors at compile time
///
/// Misuse is reported on the offending tokens, all problems at once: a
/// non-`async` function, a missing `key`, an unknown or repeated argument, a
/// bad or zero duration, a `key` or `fingerprint` naming something that is
/// not an argument, a return type that is not a `Result`, an error type
/// without `From<idem::Error>`, and a value, key or fingerprint of the wrong
/// kind.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into(), crate_path::runtime).into()
}
