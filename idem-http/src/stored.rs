//! The stored form of a response, and which headers it keeps.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::response::Parts;
use serde::{Deserialize, Serialize};

/// Bytes stored as a JSON string when they are UTF-8 (the common case: JSON
/// bodies, header values), else as base64, so records stay compact.
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

    pub(crate) fn to_bytes(&self) -> Result<Bytes, base64::DecodeError> {
        match self {
            Blob::Text(s) => Ok(Bytes::copy_from_slice(s.as_bytes())),
            Blob::Base64 { b64 } => B64.decode(b64).map(Bytes::from),
        }
    }
}

/// Record format of a kept response; a record of an unknown version is
/// refused (500) rather than misread.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// Record format of a "processed, response not kept" marker. A version of
/// its own, so that a server that predates markers refuses them (500)
/// instead of replaying them as an empty response.
pub(crate) const MARKER_VERSION: u8 = 2;

/// Why a processed request's response was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum NotKept {
    /// Its body was over `max_response_body`.
    TooLarge,
    /// Its content type is streamed through unbuffered (`text/event-stream`).
    Streamed,
    /// Its client went away while it was sent, under `cancel_on_disconnect`:
    /// the rest of its body was not read.
    ClientGone,
}

impl NotKept {
    pub(crate) fn explain(self) -> &'static str {
        match self {
            NotKept::TooLarge => "its body was over the size limit of stored responses",
            NotKept::Streamed => {
                "it was a stream (such as Server-Sent Events), which is never stored"
            }
            NotKept::ClientGone => {
                "its client went away while it was sent, and the rest of it was not read"
            }
        }
    }
}

/// A completed response as kept in the store.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    #[serde(rename = "v")]
    pub(crate) version: u8,
    #[serde(rename = "s")]
    pub(crate) status: u16,
    #[serde(rename = "h")]
    pub(crate) headers: Vec<(String, Blob)>,
    #[serde(rename = "b")]
    pub(crate) body: Blob,
    /// Set on markers: the request was processed, its response not kept.
    #[serde(rename = "nk", default, skip_serializing_if = "Option::is_none")]
    pub(crate) not_kept: Option<NotKept>,
    /// The response as the handler produced it, for the request that ran the
    /// handler (it gets every header, `Set-Cookie` included). Never stored.
    #[serde(skip)]
    pub(crate) live: Option<Live>,
}

/// The original response of the run that executed the handler.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// A kept response, carrying the live one for the request that ran it.
    #[cfg(test)]
    pub(crate) fn new(parts: Parts, body: Bytes, replay_set_cookie: bool) -> StoredResponse {
        let mut stored = StoredHead::of(&parts, replay_set_cookie).with_body(&body);
        stored.live = Some(Live { parts, body });
        stored
    }

    /// A "processed, response not kept" marker for a response of `status`.
    pub(crate) fn not_kept(status: u16, why: NotKept) -> StoredResponse {
        StoredResponse {
            version: MARKER_VERSION,
            status,
            headers: Vec::new(),
            body: Blob::Text(String::new()),
            not_kept: Some(why),
            live: None,
        }
    }
}

/// What is stored of a response's head, taken before the head itself is sent
/// on (streamed responses reach the client before their body is complete).
#[derive(Debug)]
pub(crate) struct StoredHead {
    status: u16,
    headers: Vec<(String, Blob)>,
}

impl StoredHead {
    pub(crate) fn of(parts: &Parts, replay_set_cookie: bool) -> StoredHead {
        StoredHead {
            status: parts.status.as_u16(),
            headers: replayable_headers(&parts.headers, replay_set_cookie)
                .map(|(name, value)| (name.as_str().to_owned(), Blob::from_bytes(value.as_bytes())))
                .collect(),
        }
    }

    pub(crate) fn status(&self) -> u16 {
        self.status
    }

    pub(crate) fn with_body(self, body: &[u8]) -> StoredResponse {
        StoredResponse {
            version: FORMAT_VERSION,
            status: self.status,
            headers: self.headers,
            body: Blob::from_bytes(body),
            not_kept: None,
            live: None,
        }
    }
}

/// Headers never stored: hop-by-hop ones (RFC 9110 §7.6.1), `Date` (a replay
/// gets its own), `Content-Length` (recomputed from the stored body), and the
/// layer's own headers (added afresh on each response).
const NEVER_REPLAYED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "content-length",
    "idempotent-replayed",
    "idempotency-retention",
];

/// The headers of a response that a replay repeats.
pub(crate) fn replayable_headers(
    headers: &HeaderMap,
    replay_set_cookie: bool,
) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    // Headers named by `Connection` are hop-by-hop too.
    let listed: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect();
    headers.iter().filter(move |(name, _)| {
        let n = name.as_str();
        !NEVER_REPLAYED.contains(&n)
            && (replay_set_cookie || *name != header::SET_COOKIE)
            && !listed.iter().any(|l| l == n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_round_trips_text_and_binary() {
        for bytes in [&b"{\"a\":1}"[..], &[0xff, 0x00, 0x80][..], &b""[..]] {
            let blob = Blob::from_bytes(bytes);
            let json = serde_json::to_string(&blob).unwrap();
            let back: Blob = serde_json::from_str(&json).unwrap();
            assert_eq!(back.to_bytes().unwrap(), bytes);
        }
        assert!(matches!(Blob::from_bytes(b"hi"), Blob::Text(_)));
        assert!(matches!(Blob::from_bytes(&[0xff]), Blob::Base64 { .. }));
    }

    #[test]
    fn drops_hop_by_hop_date_and_cookies() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert(
            "date",
            HeaderValue::from_static("Mon, 01 Jan 2024 00:00:00 GMT"),
        );
        h.insert("set-cookie", HeaderValue::from_static("s=1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("connection", HeaderValue::from_static("close, X-Hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        let kept: Vec<&str> = replayable_headers(&h, false)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(kept, ["x-request-id", "content-type"]);
        let kept: Vec<&str> = replayable_headers(&h, true)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(kept, ["x-request-id", "content-type", "set-cookie"]);
    }

    #[test]
    fn stored_response_serializes_compactly() {
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.status = http::StatusCode::CREATED;
        parts
            .headers
            .insert("x-custom", HeaderValue::from_static("yes"));
        let stored = StoredResponse::new(parts, Bytes::from_static(b"{\"id\":7}"), false);
        let json = serde_json::to_string(&stored).unwrap();
        assert_eq!(
            json,
            r#"{"v":1,"s":201,"h":[["x-custom","yes"]],"b":"{\"id\":7}"}"#
        );
        let back: StoredResponse = serde_json::from_str(&json).unwrap();
        assert!(back.live.is_none());
        assert_eq!(back.status, 201);
        assert_eq!(back.not_kept, None);
    }

    #[test]
    fn markers_have_their_own_version() {
        let json =
            serde_json::to_string(&StoredResponse::not_kept(200, NotKept::TooLarge)).unwrap();
        assert_eq!(json, r#"{"v":2,"s":200,"h":[],"b":"","nk":"too-large"}"#);
        let back: StoredResponse = serde_json::from_str(&json).unwrap();
        assert_eq!(back.not_kept, Some(NotKept::TooLarge));
    }
}
