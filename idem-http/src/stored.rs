//! What is kept of a response, in the record format shared with idem-gRPC
//! (`idem_layer::record`), and which headers a replay repeats.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::response::Parts;
use idem_layer::record::{Blob, NEVER_STORED, NotKept, Record};
use idem_layer::task::Ran;

/// What one run stores, with the response of the request that ran the
/// handler (it gets every header, `Set-Cookie` included).
pub(crate) type StoredResponse = Ran<Live>;

/// The original response of the run that executed the handler.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
}

/// Why the response was not kept, in a `response-not-kept` answer.
pub(crate) fn explain(why: NotKept) -> &'static str {
    match why {
        NotKept::TooLarge => {
            "its body was over the size limit of stored responses (max_response_body, or the runtime's max_value_size once encoded)"
        }
        NotKept::Streamed => "it was a stream (such as Server-Sent Events), which is never stored",
        NotKept::ClientGone => {
            "its client went away while it was sent, and the rest of it was not read"
        }
    }
}

/// A "processed, response not kept" marker for a response of `status`.
pub(crate) fn not_kept(status: u16, why: NotKept) -> StoredResponse {
    let mut record = Record::not_kept(why);
    record.status = Some(status);
    Ran::new(record, None)
}

/// What is stored of a response's head, taken before the head itself is sent
/// on (streamed responses reach the client before their body is complete).
#[derive(Debug)]
pub(crate) struct StoredHead {
    status: u16,
    record: Record,
}

impl StoredHead {
    pub(crate) fn of(parts: &Parts, replay_set_cookie: bool) -> StoredHead {
        let mut record = Record::kept(
            replayable_headers(&parts.headers, replay_set_cookie),
            Blob::Text(String::new()),
            [],
        );
        record.status = Some(parts.status.as_u16());
        StoredHead {
            status: parts.status.as_u16(),
            record,
        }
    }

    pub(crate) fn status(&self) -> u16 {
        self.status
    }

    /// The record, and the response to send once it is stored when nothing
    /// was sent yet. A record longer than `max_value` bytes once serialized
    /// (the runtime's `max_value_size`) becomes a "processed, response not
    /// kept" marker: the runtime would keep a "too large" marker instead,
    /// which no retry can be answered from.
    pub(crate) fn with_body(
        self,
        body: &[u8],
        live: Option<Live>,
        max_value: usize,
    ) -> StoredResponse {
        let mut record = self.record;
        record.body = Blob::from_bytes(body);
        if !record.fits(max_value) {
            tracing::debug!(
                max_value_size = max_value,
                "response's record over the runtime's max_value_size: stored as processed, not kept"
            );
            let mut marker = not_kept(self.status, NotKept::TooLarge);
            if let Some(live) = live {
                marker = Ran::new(marker.record, Some(live));
            }
            return marker;
        }
        Ran::new(record, live)
    }
}

/// Headers stored by idem-gRPC but not here: HTTP/1.1's other hop-by-hop
/// ones (RFC 9110 §7.6.1) and the retention header (added afresh).
const NOT_REPLAYED_OVER_HTTP: &[&str] = &[
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
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
        !NEVER_STORED.contains(&n)
            && !NOT_REPLAYED_OVER_HTTP.contains(&n)
            && (replay_set_cookie || *name != header::SET_COOKIE)
            && !listed.iter().any(|l| l == n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        h.insert("proxy-authenticate", HeaderValue::from_static("Basic"));
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
        let stored = StoredHead::of(&parts, false).with_body(b"{\"id\":7}", None, 1 << 20);
        let json = serde_json::to_string(&stored).unwrap();
        assert_eq!(
            json,
            r#"{"v":1,"s":201,"h":[["x-custom","yes"]],"b":"{\"id\":7}"}"#
        );
        let back: StoredResponse = serde_json::from_str(&json).unwrap();
        assert!(back.take_live().is_none());
    }

    #[test]
    fn markers_have_their_own_version() {
        let json = serde_json::to_string(&not_kept(200, NotKept::TooLarge)).unwrap();
        assert_eq!(json, r#"{"v":2,"s":200,"h":[],"b":"","nk":"too-large"}"#);
        let back: StoredResponse = serde_json::from_str(&json).unwrap();
        assert_eq!(back.record.not_kept, Some(NotKept::TooLarge));
        assert_eq!(back.record.status, Some(200));
    }
}
