//! HTTP client for idem services: exactly-once operations over an
//! unreliable network.
//!
//! Every logical operation gets **one** idempotency key — a fresh UUIDv4
//! made before the first attempt, or one you supply — and every retry sends
//! that same key in the `Idempotency-Key` header. The server (backed by
//! Redis) runs the operation at most once per key and replays the stored
//! outcome to later attempts (marked `Idempotent-Replayed: true`). So it is
//! always safe for this client to retry, and to retry again later with the
//! same key after it gives up.
//!
//! Also available as `idem::client` when the `idem` facade is built with its
//! `client` feature.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_client::{Client, ClientError, ClientErrorKind, RetryPolicy};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize)]
//! struct Charge { cents: u64, currency: &'static str }
//!
//! #[derive(Deserialize)]
//! struct Receipt { id: String }
//!
//! # #[tokio::main] async fn main() -> Result<(), ClientError> {
//! let client = Client::builder("http://127.0.0.1:3000")
//!     .retry(
//!         RetryPolicy::default()
//!             .max_retries(4)
//!             .initial_backoff(Duration::from_millis(100))
//!             .max_backoff(Duration::from_secs(5)),
//!     )
//!     .timeout(Duration::from_secs(10)) // per attempt
//!     .header("authorization", "Bearer x") // sent on every request
//!     .build()?;
//!
//! // A fresh key, reused on every retry of this call.
//! let r = client.post::<_, Receipt>("/payments", &Charge { cents: 1999, currency: "EUR" }).await?;
//! println!("receipt {} (key {}, {} attempt(s), replayed: {})", r.value.id, r.key, r.attempts, r.replayed);
//!
//! // Your own key, e.g. stored with the order so a restarted process
//! // resumes the same operation instead of starting a new one.
//! match client.post_with_key::<_, Receipt>("/payments", "order-42", &Charge { cents: 1999, currency: "EUR" }).await {
//!     Ok(r) => println!("paid: {}", r.value.id),
//!     Err(e) if matches!(e.kind(), ClientErrorKind::GaveUp { .. }) => {
//!         eprintln!("try again later with the same key: {e}")
//!     }
//!     Err(e) => eprintln!("{e}"),
//! }
//! # Ok(()) }
//! ```
//!
//! # What is retried
//!
//! | outcome | retried? |
//! |---|---|
//! | connection refused/reset, timeout, broken response body | yes |
//! | `409` (same key still in progress), `429`, `502`, `503`, `504` | yes |
//! | `500` | yes, unless it carries `Idempotent-Replayed: true` |
//! | any response with `Idempotent-Replayed: true` | no — it is the stored outcome |
//! | `410` `response-not-kept`: processed, response not kept | no ([`ClientErrorKind::ResponseNotKept`]) |
//! | `400`, `422` and every other 4xx, 3xx, other 5xx | no |
//! | 2xx whose body does not decode | no ([`ClientErrorKind::Decode`]) |
//!
//! Delays follow [`RetryPolicy`]: exponential backoff with equal jitter
//! (default 0.5 s doubling to 5 s, 2 retries), `Retry-After` as a lower bound
//! (capped at 30 s), all within an overall deadline (default 30 s). When
//! retries run out the error is [`ClientErrorKind::GaveUp`], which names the last
//! status or transport error and the attempt count.
//!
//! # Timeouts and slow operations
//!
//! Each attempt times out after 30 s by default
//! ([`ClientBuilder::timeout`]), the same as the overall deadline. An idem
//! server (`idem-http`'s layer) runs a handler that has started to
//! completion even when the client disconnects, and stores its response: a
//! retry after a timeout gets `409` while the handler runs (retried, with its
//! `Retry-After`), then the stored response, never a second execution. A
//! shorter timeout is safe, it only spends attempts on `409`s. Only against
//! a server that opted into `cancel_on_disconnect(true)` does a timeout
//! cancel the handler, so that the retry runs it again.
//!
//! An operation the server processed but whose response it did not keep
//! (too large, or a stream) is [`ClientErrorKind::ResponseNotKept`]: not
//! retried, and not to be sent again under a new key.
//!
//! Redirects are not followed (a `301`/`302` would turn a `POST` into a
//! `GET`). Each attempt emits a `tracing` event with the method, path, key,
//! attempt number, status or error, and the chosen delay.

mod client;
mod error;
mod key;
mod operation;
mod problem;
mod request;
mod retry;

pub use client::{Client, ClientBuilder};
pub use error::{ClientError, ClientErrorKind, GiveUpReason, RequestContext};
pub use key::{IDEMPOTENCY_KEY, MAX_KEY_LEN, new_key, validate_key};
pub use operation::{IDEMPOTENT_REPLAYED, Response};
pub use problem::Problem;
pub use request::RequestBuilder;
pub use retry::RetryPolicy;

/// Re-exported so callers can name methods and statuses without adding
/// `http` themselves.
///
/// ```
/// use idem_client::http::{Method, StatusCode};
/// assert_eq!(Method::POST.as_str(), "POST");
/// assert_eq!(StatusCode::CREATED.as_u16(), 201);
/// ```
pub use http;
