//! A unary method the layer protects: its path, where its key comes from,
//! what its fingerprint covers and the scope its keys are stored under.

use std::fmt;
use std::sync::Arc;

/// Reads a key from a request message's bytes: `Ok(None)` when the message
/// carries none.
pub(crate) type KeyFn =
    dyn Fn(&[u8]) -> Result<Option<String>, prost::DecodeError> + Send + Sync + 'static;

/// Reads the part of a request message the fingerprint covers.
pub(crate) type PartFn =
    dyn Fn(&[u8]) -> Result<Vec<u8>, prost::DecodeError> + Send + Sync + 'static;

/// Where a method's idempotency key comes from.
#[derive(Clone)]
pub(crate) enum KeySource {
    /// The `idempotency-key` metadata entry.
    Metadata,
    /// A field of the decoded request message.
    Message(Arc<KeyFn>),
}

/// One unary RPC method under the layer, named by its full path
/// (`/package.Service/Method`, as in the HTTP/2 `:path`).
///
/// By default its key is the `idempotency-key` metadata entry, its
/// fingerprint covers the request message's bytes and its keys are
/// stored under the scope of its path. A method whose request message
/// carries its own key (Google's AIP-155 `request_id`, AEP-155's
/// `idempotency_key.key`) reads it with [`key_from_request`](Self::key_from_request).
///
/// ```
/// use idem_grpc::UnaryMethod;
///
/// #[derive(Clone, PartialEq, prost::Message)]
/// struct CreatePaymentRequest {
///     #[prost(string, tag = "1")]
///     request_id: String,
///     #[prost(int64, tag = "2")]
///     amount_cents: i64,
/// }
///
/// let method = UnaryMethod::new("/payments.v1.Payments/CreatePayment")
///     .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone()));
/// assert_eq!(method.path(), "/payments.v1.Payments/CreatePayment");
/// ```
#[derive(Clone)]
#[must_use]
pub struct UnaryMethod {
    pub(crate) path: String,
    pub(crate) key: KeySource,
    pub(crate) part: Option<Arc<PartFn>>,
    pub(crate) scope: Option<String>,
}

impl fmt::Debug for UnaryMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnaryMethod")
            .field("path", &self.path)
            .field(
                "key",
                &match self.key {
                    KeySource::Metadata => "metadata",
                    KeySource::Message(_) => "request field",
                },
            )
            .field(
                "fingerprint",
                &if self.part.is_some() {
                    "part"
                } else {
                    "message"
                },
            )
            .field("scope", &self.scope)
            .finish()
    }
}

impl UnaryMethod {
    /// The method at `path`, the full gRPC path `/package.Service/Method`
    /// (`"/" + <generated server>::NAME + "/" + method name`).
    ///
    /// ```
    /// let m = idem_grpc::UnaryMethod::new("/shop.v1.Orders/PlaceOrder");
    /// assert_eq!(m.path(), "/shop.v1.Orders/PlaceOrder");
    /// ```
    pub fn new(path: impl Into<String>) -> UnaryMethod {
        UnaryMethod {
            path: path.into(),
            key: KeySource::Metadata,
            part: None,
            scope: None,
        }
    }

    /// The method's path.
    ///
    /// ```
    /// assert_eq!(idem_grpc::UnaryMethod::new("/a.B/C").path(), "/a.B/C");
    /// ```
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Reads the key from the request message instead of the metadata:
    /// the layer decodes the message as `M` (prost) and calls `key`. `None`
    /// or an empty string (proto3's unset field) is "no key". The key
    /// follows the same grammar as the metadata entry's value once
    /// unquoted: 1–255 printable ASCII characters, not all spaces (a UUID
    /// fits); another value is refused with `INVALID_ARGUMENT`.
    ///
    /// AIP-155 (`string request_id`):
    ///
    /// ```
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct CreatePaymentRequest { #[prost(string, tag = "1")] request_id: String }
    /// let m = idem_grpc::UnaryMethod::new("/payments.v1.Payments/CreatePayment")
    ///     .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone()));
    /// ```
    ///
    /// AEP-155 (`IdempotencyKey idempotency_key = …; { string key; Timestamp first_sent; }`):
    ///
    /// ```
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct IdempotencyKey { #[prost(string, tag = "1")] key: String }
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct CreateOrderRequest { #[prost(message, optional, tag = "1")] idempotency_key: Option<IdempotencyKey> }
    /// let m = idem_grpc::UnaryMethod::new("/shop.v1.Orders/CreateOrder")
    ///     .key_from_request(|r: &CreateOrderRequest| Some(r.idempotency_key.as_ref()?.key.clone()));
    /// ```
    pub fn key_from_request<M, F>(mut self, key: F) -> Self
    where
        M: prost::Message + Default + 'static,
        F: Fn(&M) -> Option<String> + Send + Sync + 'static,
    {
        self.key = KeySource::Message(Arc::new(move |bytes: &[u8]| {
            let message = M::decode(bytes)?;
            Ok(key(&message).filter(|k| !k.is_empty()))
        }));
        self
    }

    /// Fingerprints a part of the request message instead of all its
    /// bytes: a retry that differs only outside that part is the same
    /// operation. `part` returns the bytes to hash (encode a sub-message
    /// with `prost::Message::encode_to_vec`, or concatenate fields).
    ///
    /// ```
    /// use prost::Message as _;
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct Charge { #[prost(int64, tag = "1")] amount_cents: i64 }
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct CreatePaymentRequest { #[prost(message, optional, tag = "2")] charge: Option<Charge>, #[prost(string, tag = "3")] trace_note: String }
    /// // A retry may change its trace note; the charge itself must match.
    /// let m = idem_grpc::UnaryMethod::new("/payments.v1.Payments/CreatePayment")
    ///     .fingerprint_request(|r: &CreatePaymentRequest| {
    ///         r.charge.as_ref().map(|c| c.encode_to_vec()).unwrap_or_default()
    ///     });
    /// ```
    pub fn fingerprint_request<M, F>(mut self, part: F) -> Self
    where
        M: prost::Message + Default + 'static,
        F: Fn(&M) -> Vec<u8> + Send + Sync + 'static,
    {
        self.part = Some(Arc::new(move |bytes: &[u8]| Ok(part(&M::decode(bytes)?))));
        self
    }

    /// The scope its keys are stored under, instead of its path: give two
    /// methods the same scope to make one key space of them (a key then
    /// names one operation of either; the path is in the fingerprint, so
    /// the same key on the other method is refused as reused).
    ///
    /// ```
    /// let m = idem_grpc::UnaryMethod::new("/payments.v2.Payments/CreatePayment")
    ///     .scope("/payments.v1.Payments/CreatePayment"); // v2 shares v1's keys
    /// ```
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }
}

impl From<&str> for UnaryMethod {
    fn from(path: &str) -> UnaryMethod {
        UnaryMethod::new(path)
    }
}

impl From<String> for UnaryMethod {
    fn from(path: String) -> UnaryMethod {
        UnaryMethod::new(path)
    }
}
