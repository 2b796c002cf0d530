//! `IdempotencyLayer`: the configuration, and the tower `Layer` impl.

use crate::config::Config;
use crate::method::UnaryMethod;
use crate::service::IdempotencyService;
use http::HeaderName;
use idem_core::Idempotency;
use idem_layer::settings::Settings;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;
use tonic::metadata::MetadataMap;
use tower_layer::Layer;

/// Default limit on a buffered request message: 4 MiB, gRPC's default
/// largest message.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// Default limit on a stored reply: 1 MiB (base64 in the record makes it
/// about 1.4 MiB, under the runtime's default 4 MiB `max_value_size`), or
/// less under a runtime whose `max_value_size` cannot hold that (see
/// [`IdempotencyLayer::max_response_bytes`]).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// A tower [`Layer`] giving the unary RPCs you name exactly-once semantics
/// per idempotency key, with an [`Idempotency`] runtime (Redis,
/// PostgreSQL or memory) as arbiter. Put it on a tonic server
/// (`Server::builder().layer(..)`) or around one generated service.
///
/// Only the methods named with [`unary`](Self::unary) or
/// [`method`](Self::method) are protected. A request that carries an
/// `idempotency-key` to any other method (a streaming one, say) is refused
/// with `UNIMPLEMENTED` rather than run without protection; requests
/// without a key to other methods pass through untouched.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_grpc::{IdempotencyLayer, UnaryMethod};
/// use std::time::Duration;
///
/// # #[derive(Clone, PartialEq, prost::Message)]
/// # struct CreatePaymentRequest { #[prost(string, tag = "1")] request_id: String }
/// let idem = Idempotency::builder(MemoryStore::new()).namespace("payments").build();
/// let layer = IdempotencyLayer::new(idem)
///     // key: the request's own AIP-155 `request_id`
///     .method(
///         UnaryMethod::new("/payments.v1.Payments/CreatePayment")
///             .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone())),
///     )
///     // key: the `idempotency-key` metadata entry
///     .unary("/payments.v1.Payments/RefundPayment")
///     .require_key(true)
///     .wait(Duration::from_secs(5));
/// // tonic::transport::Server::builder().layer(layer).add_service(..)
/// # let _ = layer;
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    idem: Idempotency,
    config: Config,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("idem", &self.idem)
            .field("config", &self.config)
            .finish()
    }
}

impl IdempotencyLayer {
    /// A layer over `idem` protecting no method yet (add them with
    /// [`unary`](Self::unary) or [`method`](Self::method)), with the
    /// defaults: key optional, `grpc-retry-pushback-ms: 1000` on `ABORTED`
    /// and `UNAVAILABLE`, 4 MiB request and 1 MiB stored reply limits, one
    /// key space per `authorization` value, the runtime's `result_ttl` as
    /// retention, only `OK` answers stored, no waiting for an in-flight
    /// duplicate.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).unary("/shop.v1.Orders/PlaceOrder");
    /// ```
    pub fn new(idem: Idempotency) -> IdempotencyLayer {
        let max_response = DEFAULT_MAX_RESPONSE_BYTES.min(largest_reply(&idem));
        IdempotencyLayer {
            config: Config {
                settings: Settings::new(&idem)
                    .max_request(DEFAULT_MAX_REQUEST_BYTES)
                    .max_response(max_response),
                methods: HashMap::new(),
                stored_codes: Vec::new(),
                share_round_trips: false,
                group: None,
            },
            idem,
        }
    }

    /// Protects the unary method at `path` (`/package.Service/Method`),
    /// keyed by the `idempotency-key` metadata entry.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem)
    ///     .unary("/payments.v1.Payments/CreatePayment")
    ///     .unary("/payments.v1.Payments/RefundPayment");
    /// ```
    pub fn unary(self, path: impl Into<String>) -> Self {
        self.method(UnaryMethod::new(path))
    }

    /// Protects a unary method configured with [`UnaryMethod`] (its key
    /// from the request message, its fingerprint over a part of it, its
    /// scope). A second entry for the same path replaces the first.
    ///
    /// ```
    /// # #[derive(Clone, PartialEq, prost::Message)]
    /// # struct CreatePaymentRequest { #[prost(string, tag = "1")] request_id: String }
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use idem_grpc::UnaryMethod;
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).method(
    ///     UnaryMethod::new("/payments.v1.Payments/CreatePayment")
    ///         .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone())),
    /// );
    /// ```
    pub fn method(mut self, method: impl Into<UnaryMethod>) -> Self {
        let method = method.into();
        self.config.methods.insert(method.path.clone(), method);
        self
    }

    /// Whether a request to a protected method without a key is refused
    /// with `INVALID_ARGUMENT` (`true`) or runs without idempotency
    /// (`false`, the default: AIP-155 makes `request_id` optional).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).require_key(true);
    /// ```
    pub fn require_key(self, required: bool) -> Self {
        self.with_settings(|s| s.require_key(required))
    }

    /// The retry hint sent as `grpc-retry-pushback-ms` with `ABORTED` (a
    /// call with this key is in flight) and `UNAVAILABLE` (store down);
    /// default 1 s. gRPC clients with a retry policy honour it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).retry_after(std::time::Duration::from_millis(250));
    /// ```
    pub fn retry_after(self, hint: Duration) -> Self {
        self.with_settings(|s| s.retry_after(hint))
    }

    /// How long a stored answer is replayed (default: the runtime's
    /// `result_ttl`, 24 h unless configured).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).retention(std::time::Duration::from_secs(3600));
    /// ```
    pub fn retention(self, retention: Duration) -> Self {
        self.with_settings(|s| s.retention(retention))
    }

    /// The lease of each call (default: the runtime's, 30 s unless set with
    /// `Idempotency::builder(..).lease(..)`): how long after a
    /// server dies mid-call its key stays in flight before a retry takes
    /// it over and runs the handler again. A request carrying a
    /// [`MaxLease`](crate::MaxLease) extension (set by a layer outside this
    /// one) gets the shorter of the two.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).lease(std::time::Duration::from_secs(10));
    /// ```
    pub fn lease(self, lease: Duration) -> Self {
        self.with_settings(|s| s.lease(lease))
    }

    /// A duplicate that arrives while the first call runs waits up to `d`
    /// for its answer (then gets it replayed) instead of `ABORTED` at once;
    /// never past the call's own deadline (`grpc-timeout`). A call that
    /// sends [`idem-wait`](crate::IDEM_WAIT) waits what it asks for instead
    /// (see [`max_wait`](Self::max_wait)). As in idem-http, the wait is
    /// woken by the store (MemoryStore in process, RedisStore by pub/sub);
    /// on one without notifications (PostgreSQL) the waiter reads the key
    /// again, 5 ms doubling up to 250 ms apart.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).wait(std::time::Duration::from_secs(5));
    /// ```
    pub fn wait(self, d: Duration) -> Self {
        self.with_settings(|s| s.wait(d))
    }

    /// The longest a call may ask to wait with an [`idem-wait: N`](crate::IDEM_WAIT)
    /// metadata entry (whole seconds) for the answer of an in-flight call
    /// with its key (default 10 s; zero ignores the entry). Such a
    /// duplicate waits `min(N, max_wait, its deadline)` instead of the
    /// layer's [`wait`](Self::wait), and its answer (the replay, or
    /// `ABORTED` when the wait ends first) carries
    /// [`idem-wait-applied-ms`](crate::IDEM_WAIT_APPLIED_MS), the wait it
    /// was granted.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// // `idem-wait: 3600` waits 30 s at most, and says so.
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).max_wait(std::time::Duration::from_secs(30));
    /// ```
    pub fn max_wait(self, cap: Duration) -> Self {
        self.with_settings(|s| s.max_wait(cap))
    }

    /// Error statuses stored and replayed like `OK` (default: none, so any
    /// error releases the key and a retry runs the handler again). Opt in
    /// for final refusals of your own, as Stripe stores 4xx: a declined
    /// card's `FAILED_PRECONDITION` replays instead of charging on retry.
    /// `UNAVAILABLE`, `ABORTED`, `RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED`
    /// and `INTERNAL` are transient by nature; storing them turns a
    /// momentary failure into a permanent one.
    ///
    /// ```
    /// use tonic::Code;
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem)
    ///     .store_error_codes([Code::InvalidArgument, Code::FailedPrecondition, Code::NotFound]);
    /// ```
    pub fn store_error_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.config.stored_codes = codes.into_iter().filter(|c| *c != Code::Ok).collect();
        self
    }

    /// Whether calls that reach the store in the same scheduler turn share
    /// one round trip (default `false`): their claims go as one batch, and
    /// so do their completions (idem-core's `CallGroup`); a lone call waits
    /// one scheduler turn at most. Each call is still decided, stored and
    /// answered on its own. Off by default: waiting for the turn and the
    /// hand-over of each reply from the group's task lengthen a call while
    /// the server has CPU to spare. When the server's CPU is the limit,
    /// sharing saves more than it costs (`benches/unary.rs`, 32 calls in
    /// flight, CPU-bound, local Redis: fresh calls 0.56 of the bare service
    /// with sharing, 0.52 without; replays 0.75 and 0.74). Turn it on for a
    /// service that runs its cores full, and measure.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).share_round_trips(true);
    /// ```
    pub fn share_round_trips(mut self, share: bool) -> Self {
        self.config.share_round_trips = share;
        self
    }

    /// Largest request body (the framed message) buffered to fingerprint it
    /// (default 4 MiB); a larger one is refused with `RESOURCE_EXHAUSTED`.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).max_request_bytes(64 * 1024);
    /// ```
    pub fn max_request_bytes(self, bytes: usize) -> Self {
        self.with_settings(|s| s.max_request(bytes))
    }

    /// Largest reply stored for replay (default 1 MiB). A larger one is sent
    /// as it is and recorded as "processed, answer not kept": a retry gets
    /// `FAILED_PRECONDITION` (`response-not-kept`), never a second run.
    ///
    /// The runtime's `max_value_size` (4 MiB by default) bounds the stored
    /// record, in which the reply is base64 (4 bytes for 3): a limit over
    /// what that can hold is lowered to it, with a warning (raise the
    /// runtime's `max_value_size` to keep larger replies). A reply within
    /// the limit whose record is still too long for the runtime (large
    /// metadata) is not kept either, never stored as something a retry
    /// cannot be answered from.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).max_response_bytes(256 * 1024);
    /// ```
    pub fn max_response_bytes(self, bytes: usize) -> Self {
        let largest = largest_reply(&self.idem);
        if bytes > largest {
            tracing::warn!(
                max_response_bytes = bytes,
                lowered_to = largest,
                max_value_size = self.idem.max_value_size(),
                "max_response_bytes is over what the runtime's max_value_size can store (replies are base64 in the record): lowered; raise the runtime's max_value_size to keep larger replies"
            );
        }
        self.with_settings(|s| s.max_response(bytes.min(largest)))
    }

    /// The tenant is the value of this metadata entry (an API client or
    /// account id set by your gateway or an auth interceptor), instead of
    /// the default digest of `authorization`. Requests without it share the
    /// tenant-less key space.
    ///
    /// The tenant is the value's exact bytes (a value that is not UTF-8 is
    /// a tenant of its own); for a binary entry (a name ending in `-bin`),
    /// the bytes its base64 decodes to, padded or not. A `-bin` value that
    /// is not base64 is refused with `INVALID_ARGUMENT` (`invalid-tenant`).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem)
    ///     .tenant_from_metadata(http::HeaderName::from_static("x-tenant-id"));
    /// ```
    pub fn tenant_from_metadata(self, name: HeaderName) -> Self {
        self.with_settings(|s| s.tenant_from_header(name))
    }

    /// The tenant is a SHA-256 digest of these metadata entries'
    /// values (credentials never reach the store), replacing the default,
    /// `authorization`. The same digest as idem-http's, so one credential
    /// has the same tenant over HTTP and gRPC.
    ///
    /// ```
    /// use http::HeaderName;
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem)
    ///     .tenant_from_credentials([http::header::AUTHORIZATION, HeaderName::from_static("x-api-key")]);
    /// ```
    pub fn tenant_from_credentials(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.with_settings(|s| s.tenant_from_credentials(names))
    }

    /// A hook naming a request's tenant from its metadata; `None` puts it
    /// in the tenant-less key space. Any string works: it is escaped (and
    /// hashed when long) before it becomes part of the stored key.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).tenant(|md: &tonic::metadata::MetadataMap| {
    ///     md.get("x-account")?.to_str().ok().map(str::to_owned)
    /// });
    /// ```
    pub fn tenant<F>(self, hook: F) -> Self
    where
        F: Fn(&MetadataMap) -> Option<String> + Send + Sync + 'static,
    {
        self.with_settings(|s| s.tenant(hook))
    }

    /// One key space for every caller: the same key from two clients is
    /// the same operation. Only for keys that cannot collide across
    /// clients (minted by the server, say).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_grpc::IdempotencyLayer::new(idem).shared_keys();
    /// ```
    pub fn shared_keys(self) -> Self {
        self.with_settings(Settings::shared_keys)
    }

    /// The settings idem-http's layer has too are set in one place.
    fn with_settings(
        mut self,
        set: impl FnOnce(Settings<MetadataMap>) -> Settings<MetadataMap>,
    ) -> Self {
        self.config.settings = set(self.config.settings);
        self
    }
}

/// The largest reply whose record the runtime can store: a larger one
/// never fits its `max_value_size`, whatever its metadata.
fn largest_reply(idem: &Idempotency) -> usize {
    idem_layer::record::largest_binary_body(idem.max_value_size())
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        let mut config = self.config.clone();
        // One group per wrapped service, for as long as it serves.
        config.group = config
            .share_round_trips
            .then(|| self.idem.group_unbounded());
        IdempotencyService::new(inner, self.idem.clone(), Arc::new(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::MemoryStore;
    use idem_layer::record::largest_binary_body;

    /// `max_response_bytes` (and its default) never exceeds the largest
    /// reply whose base64 record fits the runtime's `max_value_size`.
    #[test]
    fn the_reply_limit_is_lowered_to_what_the_runtime_can_store() {
        let small = Idempotency::builder(MemoryStore::new())
            .max_value_size(64 * 1024)
            .build();
        let largest = largest_binary_body(64 * 1024);
        assert!(largest > 40 * 1024 && largest < 48 * 1024, "{largest}");
        let layer = IdempotencyLayer::new(small.clone());
        assert_eq!(layer.config.settings.max_response, largest);
        let layer = IdempotencyLayer::new(small).max_response_bytes(1024);
        assert_eq!(layer.config.settings.max_response, 1024);

        let default = Idempotency::builder(MemoryStore::new()).build();
        let layer = IdempotencyLayer::new(default.clone());
        assert_eq!(
            layer.config.settings.max_response,
            DEFAULT_MAX_RESPONSE_BYTES
        );
        let layer = IdempotencyLayer::new(default).max_response_bytes(4 * 1024 * 1024);
        assert_eq!(
            layer.config.settings.max_response,
            largest_binary_body(4 * 1024 * 1024)
        );
        assert!(layer.config.settings.max_response < 3 * 1024 * 1024 + 1);
    }
}
