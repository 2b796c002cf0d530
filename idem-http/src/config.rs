//! The layer's settings, shared by [`IdempotencyLayer`](crate::IdempotencyLayer)
//! (which builds them) and the service (which reads them). Its own module so
//! that `layer` depends on `service` and never the other way round.

use crate::problem::{ProblemKind, problem_response};
use axum::body::Body;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, Response, header};
use std::sync::Arc;
use std::time::Duration;

/// The tenant hook's type: derives a tenant from the request head.
pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync + 'static;

/// The bypass predicate's type: `true` passes the request through unclaimed.
pub(crate) type BypassFn = dyn Fn(&Parts) -> bool + Send + Sync + 'static;

/// Where a request's tenant (its own key space) comes from.
#[derive(Clone)]
pub(crate) enum TenantSource {
    /// A digest of these request headers (credentials), when any is present.
    Credentials(Vec<HeaderName>),
    /// The user's hook.
    Hook(Arc<TenantFn>),
    /// No tenant: every request shares one key space (explicit opt-in).
    Shared,
}

impl TenantSource {
    pub(crate) fn default_credentials() -> TenantSource {
        TenantSource::Credentials(vec![header::AUTHORIZATION])
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            TenantSource::Credentials(names) => {
                let names: Vec<&str> = names.iter().map(HeaderName::as_str).collect();
                format!("credentials({})", names.join(", "))
            }
            TenantSource::Hook(_) => "hook".to_owned(),
            TenantSource::Shared => "shared".to_owned(),
        }
    }

    /// The tenant of a request, `None` for the tenant-less key space.
    pub(crate) fn tenant_of(&self, parts: &Parts) -> Option<String> {
        match self {
            TenantSource::Credentials(names) => credentials_digest(&parts.headers, names),
            TenantSource::Hook(hook) => hook(parts),
            TenantSource::Shared => None,
        }
    }
}

/// The digest tenant of the named headers' values (`idem_key::scope`'s,
/// shared with the gRPC layer), or `None` when the request carries none.
fn credentials_digest(headers: &HeaderMap, names: &[HeaderName]) -> Option<String> {
    idem_key::scope::credentials_tenant(names.iter().flat_map(|name| {
        headers
            .get_all(name)
            .iter()
            .map(move |value| (name.as_str(), value.as_bytes()))
    }))
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) retry_after: Duration,
    pub(crate) replay_set_cookie: bool,
    pub(crate) problem_type_base: String,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) tenant: TenantSource,
    pub(crate) scope: String,
    pub(crate) retention: Duration,
    pub(crate) advertise_retention: bool,
    pub(crate) lease: Option<Duration>,
    pub(crate) wait: Duration,
    pub(crate) bypass: Option<Arc<BypassFn>>,
    /// Lower-case media types (no parameters) streamed without being kept.
    pub(crate) stream_content_types: Vec<String>,
    pub(crate) cancel_on_disconnect: bool,
}

impl Config {
    pub(crate) fn problem(
        &self,
        kind: ProblemKind,
        detail: &str,
        retry_after: bool,
    ) -> Response<Body> {
        problem_response(
            &self.problem_type_base,
            kind,
            detail,
            retry_after.then_some(self.retry_after),
            None,
        )
    }

    /// Whether a response of this content type is streamed through without
    /// being kept (Server-Sent Events and the like: endless by design).
    pub(crate) fn streams_through(&self, headers: &HeaderMap) -> bool {
        if self.stream_content_types.is_empty() {
            return false;
        }
        let Some(essence) = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(str::trim)
        else {
            return false;
        };
        self.stream_content_types
            .iter()
            .any(|t| t.eq_ignore_ascii_case(essence))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parts(auth: &[&'static str]) -> Parts {
        let mut b = http::Request::builder();
        for a in auth {
            b = b.header("authorization", HeaderValue::from_static(a));
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn credentials_give_distinct_stable_tenants() {
        let src = TenantSource::default_credentials();
        assert_eq!(src.tenant_of(&parts(&[])), None);
        let a = src.tenant_of(&parts(&["Bearer a"])).unwrap();
        assert_eq!(a.len(), 5 + 32);
        assert!(a.starts_with("cred:"));
        assert_eq!(Some(&a), src.tenant_of(&parts(&["Bearer a"])).as_ref());
        assert_ne!(Some(&a), src.tenant_of(&parts(&["Bearer b"])).as_ref());
        assert_ne!(
            src.tenant_of(&parts(&["a", "b"])),
            src.tenant_of(&parts(&["ab"]))
        );
        assert_eq!(TenantSource::Shared.tenant_of(&parts(&["Bearer a"])), None);
    }
}
