//! The client and its builder: configuration, default headers and the
//! shared connection pool. Requests are built in `request`, sent in
//! `operation`.

use std::sync::Arc;
use std::time::Duration;

use http::header::ACCEPT;
use http::{HeaderMap, HeaderName, HeaderValue};
use reqwest::Url;

use crate::key::IDEMPOTENCY_KEY;
use crate::{ClientError, RetryPolicy};

/// Default per-attempt timeout: the default overall deadline. An idem
/// server runs a started handler to completion whatever the client does, so
/// an earlier timeout cannot make a slow operation faster: it only turns
/// the wait into `409`s and retries.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

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
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) http: reqwest::Client,
    /// Base URL without a trailing slash.
    pub(crate) base: String,
    pub(crate) retry: RetryPolicy,
    pub(crate) timeout: Duration,
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

    /// Builds the client. Fails with [`ClientErrorKind::Build`](crate::ClientErrorKind::Build) if the base URL
    /// is not an absolute `http`/`https` URL without query or fragment, or a
    /// header was invalid.
    ///
    /// ```
    /// use idem_client::{Client, ClientErrorKind};
    /// assert!(Client::builder("http://127.0.0.1:3000").build().is_ok());
    /// let err = Client::builder("not a url").build().unwrap_err();
    /// assert!(matches!(err.kind(), ClientErrorKind::Build { .. }));
    /// assert!(Client::builder("ftp://example.com").build().is_err());
    /// ```
    pub fn build(self) -> Result<Client, ClientError> {
        if let Some(reason) = self.error {
            return Err(ClientError::build(reason));
        }
        let build_err = ClientError::build;
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

    pub(crate) fn url(&self, path: &str) -> Result<Url, ClientError> {
        let sep = if path.starts_with('/') { "" } else { "/" };
        Url::parse(&format!("{}{sep}{path}", self.inner.base))
            .map_err(|e| ClientError::build(format!("invalid request path {path:?}: {e}")))
    }
}

pub(crate) fn convert_header<K, V>(name: K, value: V) -> Result<(HeaderName, HeaderValue), String>
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
