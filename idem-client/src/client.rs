//! The client, its builder, per-request builder and the retry loop.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use reqwest::Url;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::GiveUpReason;
use crate::key::header_value;
use crate::problem::is_problem_json;
use crate::retry::{is_retryable_status, retry_after};
use crate::{ClientError, Problem, RetryPolicy, new_key};

/// Name of the request header carrying the idempotency key.
///
/// ```
/// assert_eq!(idem_client::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Name of the response header that marks a replayed (stored) outcome; its
/// value is `true` when the server answered from its record instead of
/// running the operation.
///
/// ```
/// assert_eq!(idem_client::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Default per-attempt timeout: the default overall deadline. An idem
/// server runs a started handler to completion whatever the client does, so
/// an earlier timeout cannot make a slow operation faster: it only turns
/// the wait into `409`s and retries.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// How much of an error response body is read (for problem details).
const ERROR_BODY_CAP: usize = 64 * 1024;
/// How much of an error response body is kept in [`ClientError::Status`].
const SNIPPET_CAP: usize = 1024;

/// A successful outcome: the decoded body plus what the client knows about
/// how it was obtained.
///
/// ```
/// use http::StatusCode;
/// use idem_client::Response;
///
/// let r = Response { value: 7, key: "k".into(), status: StatusCode::CREATED, replayed: false, attempts: 1 };
/// assert_eq!(r.value, 7);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response<T> {
    /// The response body, decoded from JSON. An empty body decodes as JSON
    /// `null`, so `()` and `Option<_>` accept `204 No Content`.
    pub value: T,
    /// The idempotency key the operation was sent with.
    pub key: String,
    /// The (2xx) status of the answering attempt.
    pub status: StatusCode,
    /// `true` when the server answered `Idempotent-Replayed: true`, i.e. the
    /// operation had already been applied and this is its stored outcome.
    pub replayed: bool,
    /// Attempts made, 1 when the first attempt answered.
    pub attempts: u32,
}

/// A cheap-to-clone HTTP client for idem services.
///
/// Every operation gets one idempotency key, generated before the first
/// attempt (or supplied by the caller), and every retry of that operation
/// re-sends it in the `Idempotency-Key` header. Clones share one connection
/// pool and configuration.
///
/// See the [crate documentation](crate) for retry rules.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_client::{Client, RetryPolicy};
///
/// # async fn run() -> Result<(), idem_client::ClientError> {
/// let client = Client::builder("http://127.0.0.1:3000")
///     .retry(RetryPolicy::default().max_retries(4))
///     .timeout(Duration::from_secs(10))
///     .build()?;
/// let other = client.clone(); // same pool
/// let r = other.post::<_, serde_json::Value>("/payments", &serde_json::json!({"cents": 100})).await?;
/// println!("{} after {} attempt(s), key {}", r.status, r.attempts, r.key);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    /// Base URL without a trailing slash.
    base: String,
    retry: RetryPolicy,
    timeout: Duration,
}

/// Configures a [`Client`]; made by [`Client::builder`].
///
/// Errors (a bad base URL or header) are reported by [`build`](Self::build).
///
/// ```
/// use std::time::Duration;
/// use idem_client::{Client, RetryPolicy};
///
/// let client = Client::builder("http://127.0.0.1:3000/api")
///     .retry(RetryPolicy::default().max_retries(4))
///     .timeout(Duration::from_secs(5))
///     .header("authorization", "Bearer x")
///     .build()
///     .unwrap();
/// assert_eq!(client.base_url(), "http://127.0.0.1:3000/api");
/// ```
#[derive(Debug)]
#[must_use = "a ClientBuilder does nothing until .build() is called"]
pub struct ClientBuilder {
    base: String,
    retry: RetryPolicy,
    timeout: Duration,
    headers: HeaderMap,
    error: Option<String>,
}

impl ClientBuilder {
    /// Sets the retry policy (default: [`RetryPolicy::default`]).
    ///
    /// ```
    /// use idem_client::{Client, RetryPolicy};
    /// let client = Client::builder("http://localhost:3000")
    ///     .retry(RetryPolicy::no_retries())
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(client.retry_policy().get_max_retries(), 0);
    /// ```
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Sets the timeout of each attempt, from connecting until the response
    /// body is read (default 30 s, the default overall deadline). The
    /// policy's deadline may shorten it.
    ///
    /// A timeout drops the connection, but an idem server (`idem-http`)
    /// keeps running a handler that has started and stores its response;
    /// the retry gets `409` (retried) until it is done, then the stored
    /// response. A server configured with `cancel_on_disconnect(true)`
    /// instead stops the handler, and the retry runs it again: there, give
    /// attempts time to finish.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::Client;
    /// let client = Client::builder("http://localhost:3000")
    ///     .timeout(Duration::from_secs(2))
    ///     .build()
    ///     .unwrap();
    /// # let _ = client;
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Adds a header sent on every request, replacing an earlier one of the
    /// same name. `Authorization`, `Proxy-Authorization` and `Cookie` values
    /// are marked sensitive (hidden from `Debug`). `Idempotency-Key` cannot
    /// be a default header: it is per operation.
    ///
    /// ```
    /// use idem_client::Client;
    /// let client = Client::builder("http://localhost:3000")
    ///     .header("authorization", "Bearer x")
    ///     .header("x-tenant", "acme")
    ///     .build()
    ///     .unwrap();
    /// assert!(!format!("{client:?}").contains("Bearer x"));
    ///
    /// let bad = Client::builder("http://localhost:3000").header("bad name", "v").build();
    /// assert!(bad.is_err());
    /// ```
    pub fn header<K, V>(mut self, name: K, value: V) -> Self
    where
        HeaderName: TryFrom<K>,
        <HeaderName as TryFrom<K>>::Error: Into<http::Error>,
        HeaderValue: TryFrom<V>,
        <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
    {
        if self.error.is_some() {
            return self;
        }
        match convert_header(name, value) {
            Ok((name, _)) if name.as_str() == IDEMPOTENCY_KEY => {
                self.error = Some(
                    "Idempotency-Key cannot be a default header: it must differ per operation \
                     (use post_with_key or RequestBuilder::key)"
                        .to_owned(),
                );
            }
            Ok((name, value)) => {
                self.headers.insert(name, value);
            }
            Err(reason) => self.error = Some(reason),
        }
        self
    }

    /// Builds the client. Fails with [`ClientError::Build`] if the base URL
    /// is not an absolute `http`/`https` URL without query or fragment, or a
    /// header was invalid.
    ///
    /// ```
    /// use idem_client::{Client, ClientError};
    /// assert!(Client::builder("http://127.0.0.1:3000").build().is_ok());
    /// assert!(matches!(Client::builder("not a url").build(), Err(ClientError::Build { .. })));
    /// assert!(Client::builder("ftp://example.com").build().is_err());
    /// ```
    pub fn build(self) -> Result<Client, ClientError> {
        if let Some(reason) = self.error {
            return Err(ClientError::Build { reason });
        }
        let build_err = |reason: String| ClientError::Build { reason };
        let url = Url::parse(&self.base)
            .map_err(|e| build_err(format!("invalid base URL {:?}: {e}", self.base)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(build_err(format!(
                "base URL {:?} must use http or https",
                self.base
            )));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(build_err(format!("base URL {:?} has no host", self.base)));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(build_err(format!(
                "base URL {:?} must not have a query or fragment",
                self.base
            )));
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, application/problem+json"),
        );
        headers.extend(self.headers);
        let http = reqwest::Client::builder()
            .user_agent(concat!("idem-client/", env!("CARGO_PKG_VERSION")))
            .default_headers(headers)
            // A 301/302/303 would turn the POST into a GET and drop the body.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| build_err(format!("could not create the HTTP client: {e}")))?;
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                base: url.as_str().trim_end_matches('/').to_owned(),
                retry: self.retry,
                timeout: self.timeout,
            }),
        })
    }
}

impl Client {
    /// Starts configuring a client for the service at `base_url`; request
    /// paths are appended to it.
    ///
    /// ```
    /// use idem_client::Client;
    /// let client = Client::builder("http://127.0.0.1:3000").build().unwrap();
    /// # let _ = client;
    /// ```
    pub fn builder(base_url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base: base_url.into(),
            retry: RetryPolicy::default(),
            timeout: DEFAULT_TIMEOUT,
            headers: HeaderMap::new(),
            error: None,
        }
    }

    /// A client with the default settings; same as
    /// `Client::builder(base_url).build()`.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://127.0.0.1:3000").unwrap();
    /// assert_eq!(client.base_url(), "http://127.0.0.1:3000");
    /// ```
    pub fn new(base_url: impl Into<String>) -> Result<Client, ClientError> {
        Self::builder(base_url).build()
    }

    /// The normalized base URL (no trailing slash).
    ///
    /// ```
    /// let client = idem_client::Client::new("http://127.0.0.1:3000/v1/").unwrap();
    /// assert_eq!(client.base_url(), "http://127.0.0.1:3000/v1");
    /// ```
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// The per-attempt timeout (see [`ClientBuilder::timeout`]).
    ///
    /// ```
    /// let client = idem_client::Client::new("http://127.0.0.1:3000").unwrap();
    /// assert_eq!(client.timeout(), std::time::Duration::from_secs(30));
    /// ```
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The client's retry policy.
    ///
    /// ```
    /// let client = idem_client::Client::new("http://127.0.0.1:3000").unwrap();
    /// assert_eq!(client.retry_policy().get_max_retries(), 2);
    /// ```
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    /// `POST`s `body` as JSON under a fresh UUIDv4 key, reused on every
    /// retry, and decodes the JSON answer.
    ///
    /// ```no_run
    /// use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize)] struct Charge { cents: u64 }
    /// # #[derive(Deserialize)] struct Receipt { id: String }
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.post::<_, Receipt>("/payments", &Charge { cents: 100 }).await?;
    /// println!("receipt {} (key {}, replayed: {})", r.value.id, r.key, r.replayed);
    /// # Ok(()) }
    /// ```
    pub async fn post<B, T>(&self, path: &str, body: &B) -> Result<Response<T>, ClientError>
    where
        B: Serialize + ?Sized,
        T: DeserializeOwned,
    {
        self.request(Method::POST, path).json(body).send().await
    }

    /// `POST`s `body` as JSON under the caller's `key`, which is validated
    /// first (see [`validate_key`](crate::validate_key)). Use it to retry an
    /// operation across process restarts: store the key with the intent.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let key = "order-42-charge";
    /// let r = client
    ///     .post_with_key::<_, serde_json::Value>("/payments", key, &serde_json::json!({"cents": 100}))
    ///     .await?;
    /// assert_eq!(r.key, key);
    /// # Ok(()) }
    /// ```
    pub async fn post_with_key<B, T>(
        &self,
        path: &str,
        key: &str,
        body: &B,
    ) -> Result<Response<T>, ClientError>
    where
        B: Serialize + ?Sized,
        T: DeserializeOwned,
    {
        self.request(Method::POST, path)
            .key(key)
            .json(body)
            .send()
            .await
    }

    /// `PATCH`es `body` as JSON under a fresh UUIDv4 key, reused on every
    /// retry.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client
    ///     .patch::<_, serde_json::Value>("/orders/42", &serde_json::json!({"status": "shipped"}))
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub async fn patch<B, T>(&self, path: &str, body: &B) -> Result<Response<T>, ClientError>
    where
        B: Serialize + ?Sized,
        T: DeserializeOwned,
    {
        self.request(Method::PATCH, path).json(body).send().await
    }

    /// `PATCH`es `body` as JSON under the caller's `key`.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client
    ///     .patch_with_key::<_, serde_json::Value>("/orders/42", "ship-42", &serde_json::json!({"status": "shipped"}))
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub async fn patch_with_key<B, T>(
        &self,
        path: &str,
        key: &str,
        body: &B,
    ) -> Result<Response<T>, ClientError>
    where
        B: Serialize + ?Sized,
        T: DeserializeOwned,
    {
        self.request(Method::PATCH, path)
            .key(key)
            .json(body)
            .send()
            .await
    }

    /// Starts a request with any method; finish it with
    /// [`RequestBuilder::send`].
    ///
    /// ```no_run
    /// use http::Method;
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client
    ///     .request(Method::POST, "/refunds")
    ///     .json(&serde_json::json!({"payment": "p_1"}))
    ///     .key("refund-p_1")
    ///     .header("x-request-source", "batch")
    ///     .send::<serde_json::Value>()
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        RequestBuilder {
            client: self.clone(),
            method,
            path: path.to_owned(),
            key: None,
            body: None,
            headers: HeaderMap::new(),
            error: None,
            retry: None,
            timeout: None,
        }
    }

    fn url(&self, path: &str) -> Result<Url, ClientError> {
        let sep = if path.starts_with('/') { "" } else { "/" };
        Url::parse(&format!("{}{sep}{path}", self.inner.base)).map_err(|e| ClientError::Build {
            reason: format!("invalid request path {path:?}: {e}"),
        })
    }
}

/// One request being prepared; made by [`Client::request`].
///
/// Nothing is sent until [`send`](Self::send). Without [`key`](Self::key) a
/// fresh UUIDv4 key is generated when `send` is called.
///
/// ```no_run
/// use std::time::Duration;
/// use http::Method;
/// use idem_client::RetryPolicy;
/// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
/// let r = client
///     .request(Method::PUT, "/accounts/7/limits")
///     .json(&serde_json::json!({"daily": 500}))
///     .retry(RetryPolicy::default().max_retries(5))
///     .timeout(Duration::from_secs(3))
///     .send::<serde_json::Value>()
///     .await?;
/// # let _ = r;
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a RequestBuilder does nothing until .send() is awaited"]
pub struct RequestBuilder {
    client: Client,
    method: Method,
    path: String,
    key: Option<String>,
    body: Option<Result<Bytes, serde_json::Error>>,
    headers: HeaderMap,
    error: Option<String>,
    retry: Option<RetryPolicy>,
    timeout: Option<Duration>,
}

impl RequestBuilder {
    /// Sets the JSON body (serialized once, now; an error is reported by
    /// `send` as [`ClientError::Encode`]).
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x")
    ///     .json(&[1, 2, 3])
    ///     .send::<()>()
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub fn json<B: Serialize + ?Sized>(mut self, body: &B) -> Self {
        self.body = Some(serde_json::to_vec(body).map(Bytes::from));
        self
    }

    /// Uses the caller's idempotency key instead of a fresh one. It is
    /// validated by `send` before anything is sent.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x").key("op-1").send::<()>().await?;
    /// assert_eq!(r.key, "op-1");
    /// # Ok(()) }
    /// ```
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header to this request, overriding a client default of the
    /// same name. Setting `Idempotency-Key` here is the same as
    /// [`key`](Self::key).
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x")
    ///     .header("x-trace", "abc")
    ///     .send::<()>()
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub fn header<K, V>(mut self, name: K, value: V) -> Self
    where
        HeaderName: TryFrom<K>,
        <HeaderName as TryFrom<K>>::Error: Into<http::Error>,
        HeaderValue: TryFrom<V>,
        <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
    {
        if self.error.is_some() {
            return self;
        }
        match convert_header(name, value) {
            Ok((name, value)) if name.as_str() == IDEMPOTENCY_KEY => match value.to_str() {
                Ok(key) => self.key = Some(key.to_owned()),
                Err(_) => {
                    self.key = Some(String::from_utf8_lossy(value.as_bytes()).into_owned());
                }
            },
            Ok((name, value)) => {
                self.headers.insert(name, value);
            }
            Err(reason) => self.error = Some(reason),
        }
        self
    }

    /// Overrides the client's retry policy for this request.
    ///
    /// ```no_run
    /// use idem_client::RetryPolicy;
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x")
    ///     .retry(RetryPolicy::no_retries())
    ///     .send::<()>()
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Overrides the client's per-attempt timeout for this request.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x")
    ///     .timeout(std::time::Duration::from_millis(500))
    ///     .send::<()>()
    ///     .await?;
    /// # let _ = r;
    /// # Ok(()) }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sends the request, retrying under one idempotency key as the policy
    /// allows, and decodes a 2xx JSON body into `T`.
    ///
    /// ```no_run
    /// # async fn run(client: idem_client::Client) -> Result<(), idem_client::ClientError> {
    /// let r = client.request(http::Method::POST, "/x")
    ///     .json(&serde_json::json!({"a": 1}))
    ///     .send::<serde_json::Value>()
    ///     .await?;
    /// println!("{} in {} attempt(s)", r.status, r.attempts);
    /// # Ok(()) }
    /// ```
    pub async fn send<T: DeserializeOwned>(self) -> Result<Response<T>, ClientError> {
        let RequestBuilder {
            client,
            method,
            path,
            key,
            body,
            headers,
            error,
            retry,
            timeout,
        } = self;
        if let Some(reason) = error {
            return Err(ClientError::Build { reason });
        }
        let key = key.unwrap_or_else(new_key);
        // The header form the server reads back as exactly this key.
        let key_value = header_value(&key)?;
        let body = match body {
            None => None,
            Some(Ok(bytes)) => Some(bytes),
            Some(Err(source)) => {
                return Err(ClientError::Encode {
                    source,
                    method,
                    path,
                });
            }
        };
        let url = client.url(&path)?;
        let inner = &client.inner;
        let op = Operation {
            http: &inner.http,
            method,
            path,
            url,
            key,
            key_value,
            headers,
            body,
        };
        let policy = retry.as_ref().unwrap_or(&inner.retry);
        op.run(policy, timeout.unwrap_or(inner.timeout)).await
    }
}

/// One logical operation: everything needed to (re)send it.
struct Operation<'a> {
    http: &'a reqwest::Client,
    method: Method,
    path: String,
    url: Url,
    key: String,
    key_value: HeaderValue,
    headers: HeaderMap,
    body: Option<Bytes>,
}

/// What one attempt produced.
enum Outcome<T> {
    Done(Response<T>),
    Final(ClientError),
    Retry(ClientError, Option<Duration>),
}

impl Operation<'_> {
    async fn run<T: DeserializeOwned>(
        self,
        policy: &RetryPolicy,
        per_attempt: Duration,
    ) -> Result<Response<T>, ClientError> {
        let start = Instant::now();
        let deadline = policy.get_deadline();
        let mut schedule = policy.schedule();
        let mut attempts: u32 = 0;
        loop {
            attempts = attempts.saturating_add(1);
            let timeout = per_attempt.min(deadline.saturating_sub(start.elapsed()));
            let (error, hint) = match self.attempt::<T>(attempts, timeout).await {
                Outcome::Done(response) => {
                    tracing::debug!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status = response.status.as_u16(),
                        replayed = response.replayed,
                        "idem request succeeded"
                    );
                    return Ok(response);
                }
                Outcome::Final(error) => {
                    tracing::info!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status = error.status().map(|s| s.as_u16()),
                        error = %error,
                        "idem request failed; not retryable"
                    );
                    return Err(error);
                }
                Outcome::Retry(error, hint) => (error, hint),
            };
            // The backoff schedule decides whether to retry at all; the
            // server's Retry-After can only lengthen the wait.
            let next = match schedule.next() {
                None => Err(GiveUpReason::RetriesExhausted),
                Some(backoff) => {
                    let delay = policy.combine(backoff, hint);
                    if start.elapsed().saturating_add(delay) >= deadline {
                        Err(GiveUpReason::DeadlineExceeded)
                    } else {
                        Ok(delay)
                    }
                }
            };
            let status = error.status().map(|s| s.as_u16());
            match next {
                Ok(delay) => {
                    tracing::warn!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status,
                        error = %error,
                        retry_after_ms = hint.map(|d| d.as_millis()),
                        delay_ms = delay.as_millis(),
                        "idem request failed; retrying with the same key"
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(reason) => {
                    tracing::warn!(
                        method = %self.method,
                        path = %self.path,
                        key = %self.key,
                        attempt = attempts,
                        status,
                        error = %error,
                        %reason,
                        "idem request failed; giving up"
                    );
                    return Err(ClientError::GaveUp {
                        last: Box::new(error),
                        reason,
                        method: self.method,
                        path: self.path,
                        key: self.key,
                        attempts,
                    });
                }
            }
        }
    }

    async fn attempt<T: DeserializeOwned>(&self, attempt: u32, timeout: Duration) -> Outcome<T> {
        let mut request = self
            .http
            .request(self.method.clone(), self.url.clone())
            .headers(self.headers.clone())
            .header(IDEMPOTENCY_KEY, self.key_value.clone())
            .timeout(timeout);
        if let Some(body) = &self.body {
            request = request
                .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
                .body(body.clone());
        }
        let transport = |source: reqwest::Error| ClientError::Transport {
            source,
            method: self.method.clone(),
            path: self.path.clone(),
            key: self.key.clone(),
            attempts: attempt,
        };
        let mut response = match request.send().await {
            Ok(response) => response,
            Err(e) => return Outcome::Retry(transport(e), None),
        };
        let status = response.status();
        let headers = response.headers();
        let replayed = headers
            .get(IDEMPOTENT_REPLAYED)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));

        if status.is_success() {
            let bytes = match response.bytes().await {
                Ok(bytes) => bytes,
                // The operation may have been applied; the same key makes
                // the retry safe and returns the stored outcome.
                Err(e) => return Outcome::Retry(transport(e), None),
            };
            let json: &[u8] = if bytes.trim_ascii().is_empty() {
                b"null"
            } else {
                &bytes
            };
            return match serde_json::from_slice(json) {
                Ok(value) => Outcome::Done(Response {
                    value,
                    key: self.key.clone(),
                    status,
                    replayed,
                    attempts: attempt,
                }),
                Err(source) => Outcome::Final(ClientError::Decode {
                    source,
                    status,
                    method: self.method.clone(),
                    path: self.path.clone(),
                    key: self.key.clone(),
                    attempts: attempt,
                }),
            };
        }

        let hint = retry_after(headers, SystemTime::now());
        let problem_json = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_problem_json);
        let body = read_capped(&mut response, ERROR_BODY_CAP).await;
        let problem = if problem_json {
            Problem::parse(&body)
        } else {
            None
        };
        let snippet =
            String::from_utf8_lossy(body.get(..SNIPPET_CAP).unwrap_or(&body)).into_owned();
        if status == StatusCode::GONE {
            if let Some(processed_status) = problem.as_ref().and_then(Problem::response_not_kept) {
                return Outcome::Final(ClientError::ResponseNotKept {
                    processed_status,
                    problem: problem.unwrap_or_default(),
                    method: self.method.clone(),
                    path: self.path.clone(),
                    key: self.key.clone(),
                    attempts: attempt,
                });
            }
        }
        let error = ClientError::Status {
            status,
            problem,
            body: snippet,
            replayed,
            method: self.method.clone(),
            path: self.path.clone(),
            key: self.key.clone(),
            attempts: attempt,
        };
        if is_retryable_status(status, replayed) {
            Outcome::Retry(error, hint)
        } else {
            Outcome::Final(error)
        }
    }
}

/// Reads at most about `cap` bytes of the body; a broken body just ends early.
async fn read_capped(response: &mut reqwest::Response, cap: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < cap {
        match response.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    buf
}

fn convert_header<K, V>(name: K, value: V) -> Result<(HeaderName, HeaderValue), String>
where
    HeaderName: TryFrom<K>,
    <HeaderName as TryFrom<K>>::Error: Into<http::Error>,
    HeaderValue: TryFrom<V>,
    <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
{
    let name = HeaderName::try_from(name).map_err(|e| {
        let e: http::Error = e.into();
        format!("invalid header name: {e}")
    })?;
    let mut value = HeaderValue::try_from(value).map_err(|e| {
        let e: http::Error = e.into();
        format!("invalid value for header {name}: {e}")
    })?;
    if matches!(
        name.as_str(),
        "authorization" | "proxy-authorization" | "cookie"
    ) {
        value.set_sensitive(true);
    }
    Ok((name, value))
}
