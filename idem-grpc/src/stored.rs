//! What is kept of an RPC's answer: initial metadata, the framed response
//! message(s) as sent, and the trailers (status included), so a replay is
//! byte for byte what the first call got. The record format is idem-http's
//! too (`idem_layer::record`), with the gRPC status code in place of the
//! HTTP status.

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use idem_layer::record::{Blob, NEVER_STORED, NotKept, Record};

/// Why the answer was not kept, in a `response-not-kept` refusal.
pub(crate) fn explain(why: NotKept) -> &'static str {
    match why {
        NotKept::TooLarge => {
            "its reply was over the size limit of stored replies (max_response_bytes, or the runtime's max_value_size once encoded)"
        }
        NotKept::Streamed => {
            "its reply was a stream of messages (the method is not unary), which is never stored"
        }
        NotKept::ClientGone => "its client went away while it was sent",
    }
}

/// A kept answer: its messages always in base64 (protobuf is binary).
pub(crate) fn kept(
    code: i32,
    headers: &HeaderMap,
    body: &[u8],
    trailers: Option<&HeaderMap>,
) -> Record {
    let mut record = Record::kept(
        storable(headers),
        Blob::binary(body),
        trailers.into_iter().flat_map(storable),
    );
    record.code = Some(code);
    record
}

/// A "processed, answer not kept" marker.
pub(crate) fn not_kept(why: NotKept) -> Record {
    let mut record = Record::not_kept(why);
    record.code = Some(0);
    record
}

fn storable(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| !NEVER_STORED.contains(&name.as_str()))
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
        let stored = kept(0, &h, &[0, 0, 0, 0, 1, 0xff], Some(&t));
        let json = serde_json::to_string(&stored).unwrap();
        let back: Record = serde_json::from_str(&json).unwrap();
        let decoded = back.decode().unwrap();
        assert_eq!(decoded.body, &[0, 0, 0, 0, 1, 0xff][..]);
        assert_eq!(decoded.headers.len(), 2, "date is not stored");
        assert_eq!(decoded.headers["x-run"], "1");
        let xs: Vec<_> = decoded.trailers.get_all("x-t").iter().collect();
        assert_eq!(xs, ["a", "b"]);
    }

    #[test]
    fn records_keep_their_format() {
        let mut h = HeaderMap::new();
        h.insert("x-run", HeaderValue::from_static("1"));
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        let json = serde_json::to_string(&kept(0, &h, &[0, 0, 0, 0, 0], Some(&t))).unwrap();
        assert_eq!(
            json,
            r#"{"v":1,"c":0,"h":[["x-run","1"]],"b":{"b64":"AAAAAAA="},"t":[["grpc-status","0"]]}"#
        );
        let json = serde_json::to_string(&kept(5, &h, &[], None)).unwrap();
        assert_eq!(json, r#"{"v":1,"c":5,"h":[["x-run","1"]],"b":{"b64":""}}"#);
    }

    #[test]
    fn markers_have_their_own_version() {
        let json = serde_json::to_string(&not_kept(NotKept::Streamed)).unwrap();
        assert_eq!(json, r#"{"v":2,"c":0,"h":[],"b":"","nk":"streamed"}"#);
    }
}
