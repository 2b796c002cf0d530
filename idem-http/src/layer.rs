//! `IdempotencyLayer`: the configuration, and the tower `Layer` impl.

use crate::config::{Config, describe};
use crate::service::IdempotencyService;
use http::request::Parts;
use http::{HeaderName, Method};
use idem_core::Idempotency;
use idem_layer::settings::Settings;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tower_layer::Layer;

/// Default limit on buffered request and response bodies: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = idem_layer::settings::DEFAULT_BODY_LIMIT;

/// Default problem `type` base: the "Problem types" section of these docs.
pub const DEFAULT_PROBLEM_TYPE_BASE: &str = "https://docs.rs/idem-http/latest/idem_http/#";

/// Default scope under which the layer stores keys.
pub const DEFAULT_SCOPE: &str = "http";

/// The content type streamed through without being kept by default:
/// Server-Sent Events, endless by design.
pub const DEFAULT_STREAM_CONTENT_TYPE: &str = "text/event-stream";

/// A tower [`Layer`] giving `POST` and `PATCH` requests `Idempotency-Key`
/// semantics, with an [`Idempotency`] runtime (Redis or memory) as arbiter.
///
/// Every setting has a default; the builder methods below change them. See
/// the [crate documentation](crate) for the behaviour, status by status.
///
/// ```
/// use axum::{Router, routing::post};
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::IdempotencyLayer;
/// use std::time::Duration;
///
/// let idem = Idempotency::builder(MemoryStore::new()).namespace("shop").build();
/// let app: Router = Router::new()
///     .route("/orders", post(|| async { "created" }))
///     .layer(
///         IdempotencyLayer::new(idem)
///             .require_key(true)
///             .retry_after(Duration::from_secs(2))
///             .problem_type_base("https://errors.example.com/idempotency/"),
///     );
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    idem: Idempotency,
    config: Config,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("idem", &self.idem)
            .field("methods", &c.methods)
            .field("require_key", &c.settings.require_key)
            .field("retry_after", &c.settings.retry_after)
            .field("replay_set_cookie", &c.replay_set_cookie)
            .field("problem_type_base", &c.problem_type_base)
            .field("max_request_body", &c.settings.max_request)
            .field("max_response_body", &c.settings.max_response)
            .field("tenant", &describe(&c.settings.tenant))
            .field("scope", &c.scope)
            .field("retention", &c.settings.retention)
            .field("advertise_retention", &c.advertise_retention)
            .field("lease", &c.settings.lease)
            .field("wait", &c.settings.wait)
            .field("max_wait", &c.settings.max_wait)
            .field("bypass", &c.bypass.is_some())
            .field("stream_content_types", &c.stream_content_types)
            .field("cancel_on_disconnect", &c.cancel_on_disconnect)
            .finish()
    }
}

impl IdempotencyLayer {
    /// A layer over `idem` with the defaults: `POST` and `PATCH`, key
    /// optional, `Retry-After: 1` on `409`, 1 MiB body limits, scope
    /// `"http"`, one key space per `Authorization` value (see
    /// [`tenant_from_headers`](Self::tenant_from_headers)), the runtime's
    /// `result_ttl` as retention (not advertised), `Set-Cookie` not
    /// replayed, `text/event-stream` streamed without being kept, handlers
    /// run to completion when the client disconnects.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem);
    /// ```
    pub fn new(idem: Idempotency) -> IdempotencyLayer {
        let max_response = DEFAULT_BODY_LIMIT.min(largest_response(&idem));
        IdempotencyLayer {
            config: Config {
                settings: Settings::new(&idem).max_response(max_response),
                methods: vec![Method::POST, Method::PATCH],
                replay_set_cookie: false,
                problem_type_base: DEFAULT_PROBLEM_TYPE_BASE.to_owned(),
                scope: DEFAULT_SCOPE.to_owned(),
                advertise_retention: false,
                bypass: None,
                stream_content_types: vec![DEFAULT_STREAM_CONTENT_TYPE.to_owned()],
                cancel_on_disconnect: false,
            },
            idem,
        }
    }

    /// The methods the layer applies to (default `POST` and `PATCH`). Requests
    /// with any other method pass through untouched.
    ///
    /// ```
    /// use http::Method;
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).methods([Method::POST, Method::PUT, Method::DELETE]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether a request without `Idempotency-Key` is refused with `400`
    /// (`true`) or passes through without idempotency (`false`, the default).
    ///
    /// Put a layer with `require_key(true)` on the routes that need it
    /// (`post(handler).layer(..)`) and an optional one elsewhere.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).require_key(true);
    /// ```
    pub fn require_key(self, required: bool) -> Self {
        self.with_settings(|s| s.require_key(required))
    }

    /// The `Retry-After` hint sent with `409` (request in flight) and `503`
    /// (store down), in whole seconds rounded up (default 1 s). A short,
    /// fixed hint, not the remaining lease: most duplicates arrive while the
    /// first request is about to finish.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).retry_after(std::time::Duration::from_secs(3));
    /// ```
    pub fn retry_after(self, hint: Duration) -> Self {
        self.with_settings(|s| s.retry_after(hint))
    }

    /// Whether replays repeat the original `Set-Cookie` headers (default
    /// `false`: a session cookie minted for the first request is usually not
    /// meant for whoever retries). The first response always has them.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).replay_set_cookie(true);
    /// ```
    pub fn replay_set_cookie(mut self, replay: bool) -> Self {
        self.config.replay_set_cookie = replay;
        self
    }

    /// The prefix of the `type` URI of problem responses; the type is this
    /// base followed by the [`ProblemKind::slug`](crate::ProblemKind::slug) (default
    /// [`DEFAULT_PROBLEM_TYPE_BASE`], which points at these docs).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem)
    ///     .problem_type_base("https://errors.example.com/idempotency/");
    /// // a 409 now has "type": "https://errors.example.com/idempotency/key-in-use"
    /// ```
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.config.problem_type_base = base.into();
        self
    }

    /// Largest request body buffered to compute the fingerprint, in bytes
    /// (default 1 MiB). A larger body is answered `413` and the handler does
    /// not run. Applies only to requests that carry a key.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).max_request_body(64 * 1024);
    /// ```
    pub fn max_request_body(self, bytes: usize) -> Self {
        self.with_settings(|s| s.max_request(bytes))
    }

    /// Largest response body stored for replay, in bytes (default 1 MiB). A
    /// larger response is streamed to the client as it is, and the key
    /// records that the request was processed but its response not kept: a
    /// retry gets `410` [`response-not-kept`](crate#response-not-kept), and
    /// the handler does not run again.
    ///
    /// The runtime's `max_value_size` (4 MiB by default) bounds the stored
    /// record: a limit over it is lowered to the largest body a record can
    /// hold, with a warning (raise the runtime's `max_value_size` to keep
    /// larger responses). A body within the limit whose record is still too
    /// long for the runtime (JSON escaping, a binary body in base64, large
    /// headers) is not kept either: the first client gets it, retries get
    /// `410`, never an error a retry cannot get past.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).max_response_body(256 * 1024);
    /// ```
    pub fn max_response_body(self, bytes: usize) -> Self {
        let largest = largest_response(&self.idem);
        if bytes > largest {
            tracing::warn!(
                max_response_body = bytes,
                lowered_to = largest,
                max_value_size = self.idem.max_value_size(),
                "max_response_body is over what the runtime's max_value_size can store: lowered; raise the runtime's max_value_size to keep larger responses"
            );
        }
        self.with_settings(|s| s.max_response(bytes.min(largest)))
    }

    /// A hook naming the tenant (account, API client) of a request, so that
    /// the same key sent by two tenants never meets: each tenant has its own
    /// key space. `None` puts the request in the tenant-less key space.
    /// Replaces the default, a digest of the credentials
    /// ([`tenant_from_headers`](Self::tenant_from_headers)).
    ///
    /// The hook sees the request head only; it typically reads an
    /// authenticated identity that an earlier layer put in the extensions, or
    /// an API-key header. Any string works: it is escaped (and hashed when
    /// long) before it becomes part of the stored key.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).tenant(|parts: &http::request::Parts| {
    ///     parts.headers.get("x-api-key")?.to_str().ok().map(str::to_owned)
    /// });
    /// ```
    pub fn tenant<F>(self, hook: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with_settings(|s| s.tenant(hook))
    }

    /// The request headers whose values (credentials) name the tenant,
    /// replacing the default, `Authorization`. A request carrying any of
    /// them gets the key space of a SHA-256 digest of their values (the
    /// credentials themselves never reach the store); a request carrying
    /// none shares the tenant-less key space with the others that carry
    /// none.
    ///
    /// So by default principal B sending principal A's key never gets A's
    /// response, and never blocks A's key. Prefer
    /// [`tenant`](Self::tenant) with the authenticated principal's id when
    /// an earlier layer puts it in the extensions: a credential that rotates
    /// then keeps its key space.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use http::header::{AUTHORIZATION, HeaderName};
    /// let layer = idem_http::IdempotencyLayer::new(idem)
    ///     .tenant_from_headers([AUTHORIZATION, HeaderName::from_static("x-api-key")]);
    /// ```
    pub fn tenant_from_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.with_settings(|s| s.tenant_from_credentials(names))
    }

    /// One key space for every request, whoever sends it: the same key from
    /// two API clients is the same operation. Only for services whose keys
    /// cannot collide across clients (they are minted by the server, say);
    /// otherwise one client can replay or block another's. The default is
    /// a key space per credential ([`tenant_from_headers`](Self::tenant_from_headers)).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).shared_keys();
    /// ```
    pub fn shared_keys(self) -> Self {
        self.with_settings(Settings::shared_keys)
    }

    /// A predicate on the request head: when it is `true` the request passes
    /// through unclaimed, as if the layer were not there (for streaming
    /// routes, webhooks with their own deduplication, …).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem)
    ///     .bypass(|parts: &http::request::Parts| parts.uri.path().starts_with("/events"));
    /// ```
    pub fn bypass<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.config.bypass = Some(Arc::new(predicate));
        self
    }

    /// Response content types (media type without parameters, any case)
    /// that are streamed to the client without being kept, replacing the
    /// default [`DEFAULT_STREAM_CONTENT_TYPE`] (`text/event-stream`). Such a
    /// response is never buffered: the key records at once that the request
    /// was processed and its response not kept (a retry gets `410`
    /// [`response-not-kept`](crate#response-not-kept)), and the stream runs
    /// as long as the client reads it. Pass an empty list to keep those
    /// responses like any other (up to [`max_response_body`](Self::max_response_body)).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem)
    ///     .stream_content_types(["text/event-stream", "application/x-ndjson"]);
    /// ```
    pub fn stream_content_types<T: Into<String>>(
        mut self,
        types: impl IntoIterator<Item = T>,
    ) -> Self {
        self.config.stream_content_types = types
            .into_iter()
            .map(|t| t.into().trim().to_ascii_lowercase())
            .collect();
        self
    }

    /// Whether a client that disconnects cancels its handler (default
    /// `false`).
    ///
    /// By default a handler that has started runs to completion, whatever
    /// the client does: hyper drops a request's future when its client goes
    /// away (a client timeout does that), and what is left of the handler
    /// then moves to a task of its own and finishes there, since a handler
    /// stopped half-way through a payment is worse than one that finishes.
    /// Its response is stored, so the client's retry gets it (`409` while it
    /// still runs).
    ///
    /// With `true` the handler is dropped at its next `.await`. It may have
    /// made effects by then, so its key is **not** released: it stays in
    /// flight until its lease ends ([`lease`](IdempotencyLayer::lease);
    /// retries get `409` with `Retry-After`), then the next retry runs the
    /// handler again, as a re-run (`Outcome::Recovered`, the idem attempt
    /// is 2). A client that leaves while a response streams stops the
    /// reading, and the key answers `410 response-not-kept` (the handler
    /// ran). Only for handlers that are safe to stop anywhere and to run
    /// again after a lease.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).cancel_on_disconnect(true);
    /// ```
    pub fn cancel_on_disconnect(mut self, cancel: bool) -> Self {
        self.config.cancel_on_disconnect = cancel;
        self
    }

    /// The scope keys are stored under (default `"http"`), within the
    /// runtime's namespace. Layers with the same scope share one key space
    /// (a key reused on another route is then a `422`); give a layer its own
    /// scope to separate it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).scope("public-api.v2");
    /// ```
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.config.scope = scope.into();
        self
    }

    /// How long a completed response is replayed (default: the runtime's
    /// `result_ttl`, 24 h unless configured). The layer passes it as the TTL
    /// of every call; it must be at least the runtime's lease.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).retention(std::time::Duration::from_secs(3600));
    /// ```
    pub fn retention(self, retention: Duration) -> Self {
        self.with_settings(|s| s.retention(retention))
    }

    /// Whether responses whose result is now stored (the first one and every
    /// replay) carry `Idempotency-Retention: <seconds>`, the retention
    /// period (default `false`). A first response that streams (its head
    /// leaves before its body is stored) does not carry it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).advertise_retention(true);
    /// ```
    pub fn advertise_retention(mut self, advertise: bool) -> Self {
        self.config.advertise_retention = advertise;
        self
    }

    /// The lease of each request's claim (default: the runtime's lease). It
    /// is renewed while the handler runs; it matters only when a server dies
    /// mid-request: the key is free again after at most this long. A
    /// request carrying a [`MaxLease`](crate::MaxLease) extension gets the
    /// shorter of the two.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).lease(std::time::Duration::from_secs(10));
    /// ```
    pub fn lease(self, lease: Duration) -> Self {
        self.with_settings(|s| s.lease(lease))
    }

    /// How long a duplicate that arrives while the first request runs waits
    /// for its response (then replayed to it) before getting `409` (default
    /// zero: `409` at once, whatever the runtime's own `wait` default). A
    /// request with `Prefer: wait=N` waits what it asks for instead (see
    /// [`max_wait`](Self::max_wait)).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let layer = idem_http::IdempotencyLayer::new(idem).wait(std::time::Duration::from_secs(2));
    /// ```
    pub fn wait(self, wait: Duration) -> Self {
        self.with_settings(|s| s.wait(wait))
    }

    /// The longest a request may ask to wait with `Prefer: wait=N` (RFC
    /// 7240) for the response of an in-flight request with its key
    /// (default 10 s; zero ignores the preference). Such a duplicate waits
    /// `min(N, max_wait)` instead of the layer's [`wait`](Self::wait), and
    /// its answer carries `Preference-Applied: wait=<that, in seconds>`:
    /// the stored response replayed as soon as it is stored, or `409`
    /// [`key-in-use`](crate#key-in-use) when the wait ends first. The wait
    /// is woken by the store (MemoryStore in process, RedisStore by
    /// pub/sub); on a store without notifications (PostgreSQL, a
    /// RedisStore made from a connection) the waiter reads the key again,
    /// 5 ms doubling up to 250 ms apart.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// // `Prefer: wait=3600` waits 30 s at most, and says so.
    /// let layer = idem_http::IdempotencyLayer::new(idem).max_wait(std::time::Duration::from_secs(30));
    /// ```
    pub fn max_wait(self, cap: Duration) -> Self {
        self.with_settings(|s| s.max_wait(cap))
    }

    /// The settings idem-grpc's layer has too are set in one place.
    fn with_settings(mut self, set: impl FnOnce(Settings<Parts>) -> Settings<Parts>) -> Self {
        self.config.settings = set(self.config.settings);
        self
    }
}

/// The largest body whose record the runtime can store (as text, its
/// shortest form): a larger one never fits its `max_value_size`.
fn largest_response(idem: &Idempotency) -> usize {
    idem_layer::record::largest_text_body(idem.max_value_size())
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService::new(inner, self.idem.clone(), Arc::new(self.config.clone()))
    }
}
