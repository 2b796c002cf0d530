//! The stored form of an HTTP exchange, the one record format of both
//! layers: status, headers, body and trailers, as compact JSON.
//!
//! Field names and versions are those both layers wrote before they shared
//! this module, so every record already in a store still replays.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

/// Record format of a kept response; a record of another version is
/// refused rather than misread.
pub const FORMAT_VERSION: u8 = 1;

/// Record format of a "processed, response not kept" marker. A version of
/// its own, so that a reader that predates markers refuses them instead of
/// replaying them as an empty response.
pub const MARKER_VERSION: u8 = 2;

/// Bytes stored as a JSON string when they are UTF-8 (the common case: JSON
/// bodies, header values), else as base64, so records stay compact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Blob {
    /// UTF-8 bytes, as a JSON string.
    Text(String),
    /// Other bytes, as `{"b64": "…"}`.
    Base64 {
        /// The bytes in standard base64, padded.
        b64: String,
    },
}

impl Blob {
    /// Text when `bytes` are UTF-8, else base64.
    pub fn from_bytes(bytes: &[u8]) -> Blob {
        match std::str::from_utf8(bytes) {
            Ok(s) => Blob::Text(s.to_owned()),
            Err(_) => Blob::Base64 {
                b64: B64.encode(bytes),
            },
        }
    }

    /// Always base64: for binary bodies (protobuf messages), where a string
    /// that happens to be valid UTF-8 would only make the record larger.
    pub fn binary(bytes: &[u8]) -> Blob {
        Blob::Base64 {
            b64: B64.encode(bytes),
        }
    }

    /// The bytes back; an error for damaged base64.
    pub fn to_bytes(&self) -> Result<Bytes, base64::DecodeError> {
        match self {
            Blob::Text(s) => Ok(Bytes::copy_from_slice(s.as_bytes())),
            Blob::Base64 { b64 } => B64.decode(b64).map(Bytes::from),
        }
    }
}

/// Why a processed request's response was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotKept {
    /// Its body was over the layer's limit of stored responses.
    TooLarge,
    /// It was a stream (Server-Sent Events, a streaming RPC's replies).
    Streamed,
    /// Its client went away while it was sent, under
    /// `cancel_on_disconnect`: the rest of its body was not read.
    ClientGone,
}

/// A completed exchange as kept in the store. `s` is an HTTP record's
/// status, `c` a gRPC record's status code (its trailers carry it on the
/// wire; the field is for operators reading records): each layer writes
/// its own and refuses a record without it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// [`FORMAT_VERSION`] for a kept response, [`MARKER_VERSION`] for a
    /// marker.
    #[serde(rename = "v")]
    pub version: u8,
    /// An HTTP record's status.
    #[serde(rename = "s", default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// A gRPC record's status code.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The kept headers (initial metadata over gRPC), in order, with
    /// repeated names repeated.
    #[serde(rename = "h")]
    pub headers: Vec<(String, Blob)>,
    /// The body as sent (over gRPC, the framed message(s)).
    #[serde(rename = "b")]
    pub body: Blob,
    /// The kept trailers (the gRPC status among them).
    #[serde(rename = "t", default, skip_serializing_if = "Vec::is_empty")]
    pub trailers: Vec<(String, Blob)>,
    /// Set on markers: the request was processed, its response not kept.
    #[serde(rename = "nk", default, skip_serializing_if = "Option::is_none")]
    pub not_kept: Option<NotKept>,
}

impl Record {
    /// A kept exchange; `headers` and `trailers` are what the layer keeps
    /// of them (see [`NEVER_STORED`]).
    pub fn kept<'h>(
        headers: impl IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
        body: Blob,
        trailers: impl IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
    ) -> Record {
        Record {
            version: FORMAT_VERSION,
            status: None,
            code: None,
            headers: encode_headers(headers),
            body,
            trailers: encode_headers(trailers),
            not_kept: None,
        }
    }

    /// A "processed, response not kept" marker.
    pub fn not_kept(why: NotKept) -> Record {
        Record {
            version: MARKER_VERSION,
            status: None,
            code: None,
            headers: Vec::new(),
            body: Blob::Text(String::new()),
            trailers: Vec::new(),
            not_kept: Some(why),
        }
    }

    /// Whether the record, serialized as the runtime stores it (compact
    /// JSON), is at most `limit` bytes: a longer one the runtime would not
    /// store (it keeps a "too large" marker instead, which a layer cannot
    /// replay). Exact; a bound computed from the parts' lengths answers
    /// most records without serializing them.
    pub fn fits(&self, limit: usize) -> bool {
        self.size_bound() <= limit || self.encoded_len().is_some_and(|n| n <= limit)
    }

    /// The length of the record's compact JSON; `None` if it cannot be
    /// serialized.
    pub fn encoded_len(&self) -> Option<usize> {
        let mut count = Count(0);
        serde_json::to_writer(&mut count, self).ok()?;
        Some(count.0)
    }

    /// An upper bound of [`encoded_len`](Self::encoded_len): every
    /// character of a string escaped the longest way JSON can (`\u00XX`,
    /// six bytes), plus the punctuation and fields around them.
    fn size_bound(&self) -> usize {
        // `{"v":..,"s":..,"c":..,"h":[],"b":{"b64":""},"t":[],"nk":".."}`
        // with the longest numbers and reason: under 128 bytes.
        const FIXED: usize = 128;
        // `["",],` around a pair, `{"b64":""}` around a blob.
        const PER_PAIR: usize = 8 + 12;
        let blob = |b: &Blob| match b {
            Blob::Text(s) => s.len().saturating_mul(6).saturating_add(2),
            // The base64 alphabet needs no escaping.
            Blob::Base64 { b64 } => b64.len().saturating_add(12),
        };
        let pairs = |list: &[(String, Blob)]| {
            list.iter().fold(0usize, |n, (name, value)| {
                n.saturating_add(name.len().saturating_mul(6))
                    .saturating_add(blob(value))
                    .saturating_add(PER_PAIR)
            })
        };
        FIXED
            .saturating_add(pairs(&self.headers))
            .saturating_add(pairs(&self.trailers))
            .saturating_add(blob(&self.body))
    }

    /// The body, headers and trailers of a kept record, ready to send; the
    /// error says what is damaged.
    pub fn decode(&self) -> Result<Decoded, String> {
        if self.version != FORMAT_VERSION {
            return Err(format!("unknown record format version {}", self.version));
        }
        Ok(Decoded {
            headers: decode_headers(&self.headers)?,
            body: self
                .body
                .to_bytes()
                .map_err(|e| format!("stored body: {e}"))?,
            trailers: decode_headers(&self.trailers)?,
        })
    }
}

/// A writer that only counts what it is given.
struct Count(usize);

impl std::io::Write for Count {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 = self.0.saturating_add(buf.len());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The largest body whose record can fit in `limit` bytes of the runtime,
/// when it is stored as base64 (idem-gRPC's messages): a larger one never
/// fits, whatever its headers. 0 when not even an empty record fits.
pub fn largest_binary_body(limit: usize) -> usize {
    let mut empty = Record::kept([], Blob::binary(&[]), []);
    // The longest gRPC status code.
    empty.code = Some(16);
    let empty = empty.encoded_len().unwrap_or(usize::MAX);
    // base64 writes 4 characters for each 3 bytes (or part of them).
    (limit.saturating_sub(empty) / 4).saturating_mul(3)
}

/// The largest body whose record can fit in `limit` bytes of the runtime,
/// when it is stored as text (idem-http's UTF-8 bodies, each byte at least
/// one character of JSON): a larger one never fits.
pub fn largest_text_body(limit: usize) -> usize {
    let mut empty = Record::kept([], Blob::Text(String::new()), []);
    // HTTP statuses have three digits.
    empty.status = Some(599);
    limit.saturating_sub(empty.encoded_len().unwrap_or(usize::MAX))
}

/// A kept record's parts, decoded.
#[derive(Debug)]
pub struct Decoded {
    /// The stored headers.
    pub headers: HeaderMap,
    /// The stored body.
    pub body: Bytes,
    /// The stored trailers.
    pub trailers: HeaderMap,
}

/// Headers neither layer stores: connection-specific ones (HTTP/2 forbids
/// them anyway), `date` (a replay gets its own), `content-length`
/// (recomputed from the stored body) and the replay marker (added afresh
/// to each replay).
pub const NEVER_STORED: &[&str] = &[
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

fn encode_headers<'h>(
    headers: impl IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
) -> Vec<(String, Blob)> {
    headers
        .into_iter()
        .map(|(name, value)| (name.as_str().to_owned(), Blob::from_bytes(value.as_bytes())))
        .collect()
}

fn decode_headers(list: &[(String, Blob)]) -> Result<HeaderMap, String> {
    let mut map = HeaderMap::with_capacity(list.len());
    for (name, value) in list {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| format!("stored header name {name:?}: {e}"))?;
        let value = value
            .to_bytes()
            .map_err(|e| format!("stored header {name}: {e}"))
            .and_then(|v| {
                HeaderValue::from_maybe_shared(v).map_err(|e| format!("stored header {name}: {e}"))
            })?;
        map.append(name, value);
    }
    Ok(map)
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
        assert!(matches!(Blob::binary(b"hi"), Blob::Base64 { .. }));
    }

    #[test]
    fn decodes_every_part_and_refuses_other_versions() {
        let mut h = HeaderMap::new();
        h.insert("x-run", HeaderValue::from_static("1"));
        let mut t = HeaderMap::new();
        t.append("x-t", HeaderValue::from_static("a"));
        t.append("x-t", HeaderValue::from_static("b"));
        let record = Record::kept(&h, Blob::binary(&[0, 1, 0xff]), &t);
        let json = serde_json::to_string(&record).unwrap();
        let back: Record = serde_json::from_str(&json).unwrap();
        let decoded = back.decode().unwrap();
        assert_eq!(decoded.headers["x-run"], "1");
        assert_eq!(decoded.body, &[0, 1, 0xff][..]);
        let xs: Vec<_> = decoded.trailers.get_all("x-t").iter().collect();
        assert_eq!(xs, ["a", "b"]);
        assert!(Record::not_kept(NotKept::Streamed).decode().is_err());
    }

    /// `fits` agrees with the length of the record's JSON, for text that
    /// JSON escapes (quotes, control characters) and for base64.
    #[test]
    fn fits_is_the_serialized_length() {
        let mut h = HeaderMap::new();
        h.insert("x-run", HeaderValue::from_static("1"));
        for body in [
            Blob::Text("\"".repeat(1000)),
            Blob::Text("\u{1}".repeat(1000)),
            Blob::Text("plain".repeat(1000)),
            Blob::binary(&[0xff; 3000]),
        ] {
            let record = Record::kept(&h, body, &h);
            let len = serde_json::to_vec(&record).unwrap().len();
            assert_eq!(record.encoded_len(), Some(len));
            assert!(record.fits(len));
            assert!(!record.fits(len - 1));
            assert!(record.size_bound() >= len);
        }
    }

    /// The largest bodies of `largest_*_body` fit in the limit with no
    /// headers, and one more byte does not.
    #[test]
    fn largest_bodies_fit_exactly() {
        for limit in [1000, 64 * 1024, 4 * 1024 * 1024] {
            let n = largest_binary_body(limit);
            let mut r = Record::kept([], Blob::binary(&vec![0; n]), []);
            r.code = Some(16);
            assert!(r.fits(limit), "{limit}");
            let mut r = Record::kept([], Blob::binary(&vec![0; n + 1]), []);
            r.code = Some(16);
            assert!(!r.fits(limit), "{limit}");
            let n = largest_text_body(limit);
            let mut r = Record::kept([], Blob::Text("a".repeat(n)), []);
            r.status = Some(599);
            assert!(r.fits(limit));
            let mut r = Record::kept([], Blob::Text("a".repeat(n + 1)), []);
            r.status = Some(599);
            assert!(!r.fits(limit));
        }
        assert_eq!(largest_binary_body(10), 0);
    }
}
