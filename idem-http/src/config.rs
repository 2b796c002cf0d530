//! The layer's settings, shared by [`IdempotencyLayer`](crate::IdempotencyLayer)
//! (which builds them) and the service (which reads them). Its own module so
//! that `layer` depends on `service` and never the other way round.

use crate::problem::{ProblemKind, problem_response};
use axum::body::Body;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, Response, header};
use idem_layer::settings::Settings;
use std::sync::Arc;

/// The bypass predicate's type: `true` passes the request through unclaimed.
pub(crate) type BypassFn = dyn Fn(&Parts) -> bool + Send + Sync + 'static;

/// Where a request's tenant comes from; the hook sees the request head.
pub(crate) type TenantSource = idem_layer::settings::TenantSource<Parts>;

/// The tenant source, for the layer's `Debug`.
pub(crate) fn describe(tenant: &TenantSource) -> String {
    match tenant {
        TenantSource::Credentials(names) => {
            let names: Vec<&str> = names.iter().map(HeaderName::as_str).collect();
            format!("credentials({})", names.join(", "))
        }
        TenantSource::Header(name) => format!("header({name})"),
        TenantSource::Hook(_) => "hook".to_owned(),
        TenantSource::Shared => "shared".to_owned(),
    }
}

#[derive(Clone)]
pub(crate) struct Config {
    /// What the gRPC layer configures alike.
    pub(crate) settings: Settings<Parts>,
    pub(crate) methods: Vec<Method>,
    pub(crate) replay_set_cookie: bool,
    pub(crate) problem_type_base: String,
    pub(crate) scope: String,
    pub(crate) advertise_retention: bool,
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
            retry_after.then_some(self.settings.retry_after),
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
