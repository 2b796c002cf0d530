//! The stored form of an RPC's answer: initial metadata, the framed
//! response message(s) as sent, and the trailers (status included), so a
//! replay is byte for byte what the first call got.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

/// Record format of a kept answer; a record of another version is refused
/// (`INTERNAL`) rather than misread.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// Record format of a "processed, answer not kept" marker: a version of its
/// own, so a reader that predates markers refuses them instead of
/// replaying an empty answer.
pub(crate) const MARKER_VERSION: u8 = 2;

/// Bytes as a JSON string when they are UTF-8 (metadata values are ASCII;
/// `-bin` ones travel base64-encoded already), else as base64. The same
/// record shape as idem-http's stored responses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum Blob {
    Text(String),
    Base64 { b64: String },
}

impl Blob {
    pub(crate) fn from_bytes(bytes: &[u8]) -> Blob {
        match std::str::from_utf8(bytes) {
            Ok(s) => Blob::Text(s.to_owned()),
            Err(_) => Blob::Base64 {
                b64: B64.encode(bytes),
            },
        }
    }

    /// Always base64: protobuf messages are binary, and a string that
    /// happens to be valid UTF-8 would only make the record larger.
    pub(crate) fn binary(bytes: &[u8]) -> Blob {
        Blob::Base64 {
            b64: B64.encode(bytes),
        }
    }

    pub(crate) fn to_bytes(&self) -> Result<Bytes, base64::DecodeError> {
        match self {
            Blob::Text(s) => Ok(Bytes::copy_from_slice(s.as_bytes())),
            Blob::Base64 { b64 } => B64.decode(b64).map(Bytes::from),
        }
    }
}

/// Why a processed RPC's answer was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum NotKept {
    /// The reply was over `max_response_bytes`.
    TooLarge,
    /// The reply held more than one message: the method streams.
    Streamed,
}

impl NotKept {
    pub(crate) fn explain(self) -> &'static str {
        match self {
            NotKept::TooLarge => "its reply was over the size limit of stored replies",
            NotKept::Streamed => {
                "its reply was a stream of messages (the method is not unary), which is never stored"
            }
        }
    }
}

/// An RPC's answer as kept in the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoredRpc {
    #[serde(rename = "v")]
    pub(crate) version: u8,
    /// The gRPC status code, for operators reading records (the trailers,
    /// or the headers of a trailers-only answer, carry it on the wire).
    #[serde(rename = "c")]
    pub(crate) code: i32,
    /// Response headers: the initial metadata.
    #[serde(rename = "h")]
    pub(crate) headers: Vec<(String, Blob)>,
    /// The response body as sent: length-prefixed messages.
    #[serde(rename = "b")]
    pub(crate) body: Blob,
    /// Trailers: `grpc-status`, `grpc-message`, details and the
    /// handler's trailing metadata.
    #[serde(rename = "t", default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) trailers: Vec<(String, Blob)>,
    /// Set on markers: the RPC was processed, its answer not kept.
    #[serde(rename = "nk", default, skip_serializing_if = "Option::is_none")]
    pub(crate) not_kept: Option<NotKept>,
}

impl StoredRpc {
    pub(crate) fn kept(
        code: i32,
        headers: &HeaderMap,
        body: &[u8],
        trailers: Option<&HeaderMap>,
    ) -> StoredRpc {
        StoredRpc {
            version: FORMAT_VERSION,
            code,
            headers: keep(headers),
            body: Blob::binary(body),
            trailers: trailers.map(keep).unwrap_or_default(),
            not_kept: None,
        }
    }

    pub(crate) fn not_kept(why: NotKept) -> StoredRpc {
        StoredRpc {
            version: MARKER_VERSION,
            code: 0,
            headers: Vec::new(),
            body: Blob::Text(String::new()),
            trailers: Vec::new(),
            not_kept: Some(why),
        }
    }
}

/// Headers never stored: HTTP/2 forbids connection-specific ones anyway;
/// `date` gets a fresh value, `content-length` is recomputed, and the
/// layer's own marker is added afresh to each replay.
const NEVER_STORED: &[&str] = &[
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "content-length",
    "idempotent-replayed",
];

fn keep(headers: &HeaderMap) -> Vec<(String, Blob)> {
    headers
        .iter()
        .filter(|(name, _)| !NEVER_STORED.contains(&name.as_str()))
        .map(|(name, value)| (name.as_str().to_owned(), Blob::from_bytes(value.as_bytes())))
        .collect()
}

/// Rebuilds a stored header list; the error says which entry is damaged.
pub(crate) fn rebuild(list: &[(String, Blob)]) -> Result<HeaderMap, String> {
    let mut map = HeaderMap::with_capacity(list.len());
    for (name, value) in list {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| format!("stored metadata name {name:?}: {e}"))?;
        let value = value
            .to_bytes()
            .map_err(|e| format!("stored metadata {name}: {e}"))
            .and_then(|v| {
                HeaderValue::from_maybe_shared(v)
                    .map_err(|e| format!("stored metadata {name}: {e}"))
            })?;
        map.append(name, value);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_part() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/grpc"));
        h.insert("x-run", HeaderValue::from_static("1"));
        h.insert("date", HeaderValue::from_static("now"));
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        t.append("x-t", HeaderValue::from_static("a"));
        t.append("x-t", HeaderValue::from_static("b"));
        let stored = StoredRpc::kept(0, &h, &[0, 0, 0, 0, 1, 0xff], Some(&t));
        let json = serde_json::to_string(&stored).unwrap();
        let back: StoredRpc = serde_json::from_str(&json).unwrap();
        assert_eq!(back.body.to_bytes().unwrap(), &[0, 0, 0, 0, 1, 0xff][..]);
        let headers = rebuild(&back.headers).unwrap();
        assert_eq!(headers.len(), 2, "date is not stored");
        assert_eq!(headers["x-run"], "1");
        let trailers = rebuild(&back.trailers).unwrap();
        let xs: Vec<_> = trailers.get_all("x-t").iter().collect();
        assert_eq!(xs, ["a", "b"]);
    }

    #[test]
    fn markers_have_their_own_version() {
        let json = serde_json::to_string(&StoredRpc::not_kept(NotKept::Streamed)).unwrap();
        assert_eq!(json, r#"{"v":2,"c":0,"h":[],"b":"","nk":"streamed"}"#);
    }
}
