//! The layer's settings, shared by [`IdempotencyLayer`](crate::IdempotencyLayer)
//! (which builds them) and the service (which reads them), and the
//! statuses the layer answers itself.

use crate::RETRY_PUSHBACK;
use crate::method::UnaryMethod;
use base64::Engine as _;
use base64::alphabet;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use http::{HeaderMap, HeaderValue, Response};
use idem_layer::settings::Settings;
use std::collections::HashMap;
use tonic::Code;
use tonic::metadata::MetadataMap;

/// Where a request's tenant comes from; the hook sees the metadata.
pub(crate) type TenantSource = idem_layer::settings::TenantSource<MetadataMap>;

/// The tenant of a request as bytes, `None` for the tenant-less key space;
/// the error, for a `-bin` entry that is not base64, says what to send.
///
/// A binary (`-bin`) metadata entry travels base64-encoded, padded or not
/// (gRPC's spec has receivers accept both): its tenant is the decoded
/// bytes, so both forms of one value are one tenant.
pub(crate) fn tenant_of(
    tenant: &TenantSource,
    headers: &HeaderMap,
) -> Result<Option<Vec<u8>>, String> {
    if let TenantSource::Header(name) = tenant
        && name.as_str().ends_with("-bin")
    {
        let Some(value) = headers.get(name) else {
            return Ok(None);
        };
        return BIN.decode(value.as_bytes()).map(Some).map_err(|e| {
                format!(
                    "the tenant metadata entry {name} is not base64 ({e}); send its value base64-encoded, as binary metadata is"
                )
            });
    }
    Ok(tenant.tenant_of(headers, |hook| {
        hook(&MetadataMap::from_headers(headers.clone()))
    }))
}

/// Binary metadata's base64: the standard alphabet, padding optional.
const BIN: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// What idem-http's layer configures alike.
    pub(crate) settings: Settings<MetadataMap>,
    pub(crate) methods: HashMap<String, UnaryMethod>,
    pub(crate) stored_codes: Vec<Code>,
    /// Whether concurrent calls share their store round trips.
    pub(crate) share_round_trips: bool,
    /// The group they share them in, made when the layer wraps a service.
    pub(crate) group: Option<idem_core::CallGroup>,
}

impl Config {
    /// Whether an answer with this status is stored (and replayed).
    pub(crate) fn stores(&self, code: i32) -> bool {
        code == 0 || self.stored_codes.iter().any(|c| *c as i32 == code)
    }
}

/// Why the layer answers a request itself; the slug travels in the
/// [`IDEM_ERROR`](crate::IDEM_ERROR) metadata entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    InvalidKey,
    InvalidTenant,
    MissingKey,
    UnreadableRequest,
    CompressedRequest,
    RequestTooLarge,
    NotUnary,
    KeyInUse,
    KeyReused,
    ResponseNotKept,
    StoreUnavailable,
    StoreNotConfirmed,
    HandlerPanicked,
    ResponseFailed,
    Internal,
}

impl Refusal {
    pub(crate) fn slug(self) -> &'static str {
        match self {
            Refusal::InvalidKey => "invalid-key",
            Refusal::InvalidTenant => "invalid-tenant",
            Refusal::MissingKey => "missing-key",
            Refusal::UnreadableRequest => "unreadable-request",
            Refusal::CompressedRequest => "compressed-request",
            Refusal::RequestTooLarge => "request-too-large",
            Refusal::NotUnary => "not-unary",
            Refusal::KeyInUse => "key-in-use",
            Refusal::KeyReused => "key-reused",
            Refusal::ResponseNotKept => "response-not-kept",
            Refusal::StoreUnavailable => "store-unavailable",
            Refusal::StoreNotConfirmed => "store-not-confirmed",
            Refusal::HandlerPanicked => "handler-panicked",
            Refusal::ResponseFailed => "response-failed",
            Refusal::Internal => "internal-error",
        }
    }

    pub(crate) fn code(self) -> Code {
        match self {
            Refusal::InvalidKey
            | Refusal::InvalidTenant
            | Refusal::MissingKey
            | Refusal::UnreadableRequest => Code::InvalidArgument,
            Refusal::CompressedRequest | Refusal::NotUnary => Code::Unimplemented,
            Refusal::RequestTooLarge => Code::ResourceExhausted,
            Refusal::KeyInUse => Code::Aborted,
            Refusal::KeyReused | Refusal::ResponseNotKept => Code::FailedPrecondition,
            Refusal::StoreUnavailable | Refusal::StoreNotConfirmed => Code::Unavailable,
            Refusal::HandlerPanicked | Refusal::ResponseFailed | Refusal::Internal => {
                Code::Internal
            }
        }
    }

    /// Whether the answer carries the retry hint: only when retrying with
    /// the same key can succeed soon.
    fn pushback(self) -> bool {
        matches!(
            self,
            Refusal::KeyInUse | Refusal::StoreUnavailable | Refusal::StoreNotConfirmed
        )
    }
}

/// A trailers-only answer: the status, its message, the slug and, for
/// retryable refusals, `grpc-retry-pushback-ms`.
pub(crate) fn refuse(cfg: &Config, why: Refusal, message: &str) -> Response<tonic::body::Body> {
    let mut metadata = MetadataMap::new();
    metadata.insert(
        "idem-error",
        tonic::metadata::MetadataValue::from_static(why.slug()),
    );
    let mut response = tonic::Status::with_metadata(why.code(), message, metadata)
        .into_http::<tonic::body::Body>();
    if why.pushback() {
        let ms = u64::try_from(cfg.settings.retry_after.as_millis()).unwrap_or(u64::MAX);
        response
            .headers_mut()
            .insert(RETRY_PUSHBACK, HeaderValue::from(ms));
    }
    response
}
