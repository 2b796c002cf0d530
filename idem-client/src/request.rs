//! Building one operation: the shortcuts on [`Client`] and
//! [`RequestBuilder`], which validates everything before anything is sent.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::client::convert_header;
use crate::error::RequestContext;
use crate::key::{IDEMPOTENCY_KEY, header_value};
use crate::operation::{Operation, Response};
use crate::{Client, ClientError, ClientErrorKind, RetryPolicy, new_key};

impl Client {
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
    /// `send` as [`ClientErrorKind::Encode`](crate::ClientErrorKind::Encode)).
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
            return Err(ClientError::build(reason));
        }
        let key = key.unwrap_or_else(new_key);
        // The header form the server reads back as exactly this key.
        let key_value = header_value(&key)?;
        let body = match body {
            None => None,
            Some(Ok(bytes)) => Some(bytes),
            Some(Err(source)) => {
                // Nothing was sent yet: no attempts.
                let request = RequestContext::new(method, path, key, 0);
                return Err(ClientError::request(
                    ClientErrorKind::Encode { source },
                    request,
                ));
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
