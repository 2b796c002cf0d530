//! The settings both layers have, with their defaults, and where a
//! request's tenant (its own key space) comes from.

use crate::wait::{DEFAULT_MAX_WAIT, Wait};
use http::{HeaderMap, HeaderName, header};
use idem_core::{Call, Fingerprint, Idempotency};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Default limit on buffered request and stored response bodies: 1 MiB
/// (idem-http's `DEFAULT_BODY_LIMIT`, and idem-gRPC's stored replies).
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// A tenant hook: names the tenant of a request from what the layer hands
/// it (`http::request::Parts` over HTTP, the metadata over gRPC).
pub type TenantFn<H> = dyn Fn(&H) -> Option<String> + Send + Sync + 'static;

/// Where a request's tenant (its own key space) comes from.
pub enum TenantSource<H: ?Sized> {
    /// A digest of these headers' values (credentials), when any is present.
    Credentials(Vec<HeaderName>),
    /// The value of this header, its exact bytes (a tenant id set by a
    /// gateway).
    Header(HeaderName),
    /// The user's hook.
    Hook(Arc<TenantFn<H>>),
    /// No tenant: every request shares one key space (explicit opt-in).
    Shared,
}

impl<H: ?Sized> Clone for TenantSource<H> {
    fn clone(&self) -> Self {
        match self {
            TenantSource::Credentials(names) => TenantSource::Credentials(names.clone()),
            TenantSource::Header(name) => TenantSource::Header(name.clone()),
            TenantSource::Hook(hook) => TenantSource::Hook(Arc::clone(hook)),
            TenantSource::Shared => TenantSource::Shared,
        }
    }
}

impl<H: ?Sized> fmt::Debug for TenantSource<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantSource::Credentials(names) => f.debug_tuple("Credentials").field(names).finish(),
            TenantSource::Header(name) => f.debug_tuple("Header").field(name).finish(),
            TenantSource::Hook(_) => f.write_str("Hook"),
            TenantSource::Shared => f.write_str("Shared"),
        }
    }
}

impl<H: ?Sized> TenantSource<H> {
    /// The default: a key space per `authorization` value.
    pub fn default_credentials() -> Self {
        TenantSource::Credentials(vec![header::AUTHORIZATION])
    }

    /// The tenant of a request as bytes (for `idem_key::scope::compose_bytes`),
    /// `None` for the tenant-less key space. `call_hook` runs the user's
    /// hook on what it takes; it is called only for a hook, so a layer
    /// builds that input only when it is needed.
    ///
    /// A header's tenant is the value's exact bytes: header values need not
    /// be UTF-8, and a lossy decoding would make two different values one
    /// tenant.
    pub fn tenant_of(
        &self,
        headers: &HeaderMap,
        call_hook: impl FnOnce(&TenantFn<H>) -> Option<String>,
    ) -> Option<Vec<u8>> {
        match self {
            TenantSource::Credentials(names) => {
                idem_key::scope::credentials_tenant(names.iter().flat_map(|name| {
                    headers
                        .get_all(name)
                        .iter()
                        .map(move |value| (name.as_str(), value.as_bytes()))
                }))
                .map(String::into_bytes)
            }
            TenantSource::Header(name) => headers.get(name).map(|v| v.as_bytes().to_vec()),
            TenantSource::Hook(hook) => call_hook(&**hook).map(String::into_bytes),
            TenantSource::Shared => None,
        }
    }
}

/// What both layers configure alike, with the same defaults; the
/// layers' setters of the same names document each one.
#[must_use]
pub struct Settings<H: ?Sized> {
    /// Refuse requests without a key (else they run without idempotency).
    pub require_key: bool,
    /// The retry hint of answers a retry with the same key can get past
    /// (`Retry-After`, `grpc-retry-pushback-ms`).
    pub retry_after: Duration,
    /// How long a stored response is replayed: the TTL of each call.
    pub retention: Duration,
    /// The lease of each claim; `None` for the runtime's.
    pub lease: Option<Duration>,
    /// How long a duplicate waits for an in-flight first request, unless
    /// it asks for a wait of its own.
    pub wait: Duration,
    /// The cap of the wait a request asks for (HTTP's `Prefer: wait=N`,
    /// gRPC's `idem-wait`); zero: requests' waits are ignored.
    pub max_wait: Duration,
    /// Where a request's tenant comes from.
    pub tenant: TenantSource<H>,
    /// Largest request body buffered to read its key and fingerprint.
    pub max_request: usize,
    /// Largest response body stored for replay.
    pub max_response: usize,
    /// The runtime's `max_value_size`: a record longer than this once
    /// serialized is not kept (the runtime would store a "too large"
    /// marker, which no layer can replay).
    pub max_value: usize,
}

impl<H: ?Sized> Clone for Settings<H> {
    fn clone(&self) -> Self {
        Settings {
            require_key: self.require_key,
            retry_after: self.retry_after,
            retention: self.retention,
            lease: self.lease,
            wait: self.wait,
            max_wait: self.max_wait,
            tenant: self.tenant.clone(),
            max_request: self.max_request,
            max_response: self.max_response,
            max_value: self.max_value,
        }
    }
}

impl<H: ?Sized> fmt::Debug for Settings<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("require_key", &self.require_key)
            .field("retry_after", &self.retry_after)
            .field("retention", &self.retention)
            .field("lease", &self.lease)
            .field("wait", &self.wait)
            .field("max_wait", &self.max_wait)
            .field("tenant", &self.tenant)
            .field("max_request", &self.max_request)
            .field("max_response", &self.max_response)
            .field("max_value", &self.max_value)
            .finish()
    }
}

impl<H: ?Sized> Settings<H> {
    /// The defaults: key optional, a 1 s retry hint, the runtime's
    /// `result_ttl` as retention and its lease, no waiting (a duplicate is
    /// refused at once, whatever the runtime's own `wait` default), one
    /// key space per `authorization` value, 1 MiB body limits, and a wait
    /// a request asks for granted up to [`DEFAULT_MAX_WAIT`] (10 s).
    pub fn new(idem: &Idempotency) -> Self {
        Settings {
            require_key: false,
            retry_after: Duration::from_secs(1),
            retention: idem.result_ttl(),
            lease: None,
            wait: Duration::ZERO,
            max_wait: DEFAULT_MAX_WAIT,
            tenant: TenantSource::default_credentials(),
            max_request: DEFAULT_BODY_LIMIT,
            max_response: DEFAULT_BODY_LIMIT,
            max_value: idem.max_value_size(),
        }
    }

    /// Sets [`require_key`](Self::require_key).
    pub fn require_key(mut self, required: bool) -> Self {
        self.require_key = required;
        self
    }

    /// Sets [`retry_after`](Self::retry_after).
    pub fn retry_after(mut self, hint: Duration) -> Self {
        self.retry_after = hint;
        self
    }

    /// Sets [`retention`](Self::retention).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`lease`](Self::lease).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Sets [`wait`](Self::wait).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`max_wait`](Self::max_wait).
    pub fn max_wait(mut self, cap: Duration) -> Self {
        self.max_wait = cap;
        self
    }

    /// How long a request that asked to wait `asked` (`None`: it did not
    /// ask) waits for an in-flight duplicate under these settings.
    pub fn wait_for(&self, asked: Option<Duration>) -> Wait {
        Wait::of(asked, self.max_wait, self.wait)
    }

    /// Names each request's tenant with `hook` ([`TenantSource::Hook`]).
    pub fn tenant<F>(mut self, hook: F) -> Self
    where
        F: Fn(&H) -> Option<String> + Send + Sync + 'static,
    {
        self.tenant = TenantSource::Hook(Arc::new(hook));
        self
    }

    /// A tenant per digest of these headers' values
    /// ([`TenantSource::Credentials`]).
    pub fn tenant_from_credentials(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.tenant = TenantSource::Credentials(names.into_iter().collect());
        self
    }

    /// The tenant is this header's value ([`TenantSource::Header`]).
    pub fn tenant_from_header(mut self, name: HeaderName) -> Self {
        self.tenant = TenantSource::Header(name);
        self
    }

    /// One key space for every request ([`TenantSource::Shared`]).
    pub fn shared_keys(mut self) -> Self {
        self.tenant = TenantSource::Shared;
        self
    }

    /// Sets [`max_request`](Self::max_request).
    pub fn max_request(mut self, bytes: usize) -> Self {
        self.max_request = bytes;
        self
    }

    /// Sets [`max_response`](Self::max_response).
    pub fn max_response(mut self, bytes: usize) -> Self {
        self.max_response = bytes;
        self
    }
}

/// A request extension that bounds the lease of the request's claim: the
/// claim's lease is the shorter of this and the layer's (or the runtime's)
/// lease. Something outside the layer sets it when it knows how long the
/// request can run at most, so that a request cut off at that point frees
/// its key for the client's retry no later than then; idem-lambda's HTTP
/// service sets it to the time left before the invocation's deadline.
///
/// ```
/// use idem_layer::settings::MaxLease;
/// use std::time::Duration;
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(MaxLease(Duration::from_secs(3)));
/// assert_eq!(request.extensions().get::<MaxLease>(), Some(&MaxLease(Duration::from_secs(3))));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxLease(pub Duration);

/// What one request claims: its key in its scope, with its fingerprint.
pub struct Claim {
    /// The runtime the layer runs on.
    pub idem: Idempotency,
    /// The layer's scope with the request's tenant
    /// (`idem_key::scope::compose_bytes`).
    pub scope: String,
    /// The request's idempotency key.
    pub key: String,
    /// The request's fingerprint: a request under the same key with
    /// another one is refused.
    pub fingerprint: Fingerprint,
    /// The longest lease this request's claim may get, when something
    /// outside the layer bounds it (a serverless invocation's deadline):
    /// the claim's lease is the shorter of this and the settings' (or the
    /// runtime's) lease.
    pub max_lease: Option<Duration>,
}

impl Claim {
    /// The runtime call of this claim under `settings`.
    pub fn call<H: ?Sized>(&self, settings: &Settings<H>) -> Call<'_> {
        self.call_waiting(settings, settings.wait)
    }

    /// The runtime call of this claim under `settings`, waiting up to
    /// `wait` for an in-flight duplicate (the request's own wait, from
    /// [`Settings::wait_for`]) instead of the settings' `wait`.
    pub fn call_waiting<H: ?Sized>(&self, settings: &Settings<H>, wait: Duration) -> Call<'_> {
        let call = self
            .idem
            .call(&self.scope, self.key.as_str())
            .fingerprint_raw(self.fingerprint)
            .ttl(settings.retention)
            .wait(wait);
        let lease = match (settings.lease, self.max_lease) {
            (Some(lease), Some(max)) => Some(lease.min(max)),
            (Some(lease), None) => Some(lease),
            (None, Some(max)) => Some(self.idem.lease().min(max)),
            (None, None) => None,
        };
        match lease {
            Some(lease) => call.lease(lease),
            None => call,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(auth: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in auth {
            h.append("authorization", HeaderValue::from_static(a));
        }
        h
    }

    #[test]
    fn credentials_give_distinct_stable_tenants() {
        let src = TenantSource::<()>::default_credentials();
        let of = |auth: &[&'static str]| src.tenant_of(&headers(auth), |_| None);
        assert_eq!(of(&[]), None);
        let a = of(&["Bearer a"]).unwrap();
        assert_eq!(a.len(), 5 + 32);
        assert!(a.starts_with(b"cred:"));
        assert_eq!(Some(&a), of(&["Bearer a"]).as_ref());
        assert_ne!(Some(&a), of(&["Bearer b"]).as_ref());
        assert_ne!(of(&["a", "b"]), of(&["ab"]));
        let shared = TenantSource::<()>::Shared;
        assert_eq!(shared.tenant_of(&headers(&["Bearer a"]), |_| None), None);
    }

    /// A header tenant is the value's exact bytes: two non-UTF-8 values are
    /// two tenants, and a UTF-8 value keeps the scope it always had.
    #[test]
    fn a_header_tenant_is_its_exact_bytes() {
        let src = TenantSource::<()>::Header(HeaderName::from_static("x-tenant"));
        let of = |value: &[u8]| {
            let mut h = HeaderMap::new();
            h.insert("x-tenant", HeaderValue::from_bytes(value).unwrap());
            let tenant = src.tenant_of(&h, |_| None);
            idem_key::scope::compose_bytes("s", tenant.as_deref())
        };
        assert_ne!(of(b"acme\xff"), of(b"acme\xfe"));
        assert_eq!(of(b"acme"), idem_key::scope::compose("s", Some("acme")));
        assert_eq!(of(b"acme\xff"), "s|acme%FF");
    }
}
