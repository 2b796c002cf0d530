//! Replaying a stored response whose body has a content coding (a
//! compression layer inside the idempotency layer compressed it for the
//! first request) to a request that may not accept that coding.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};
use std::io::Read;

/// Largest body a stored compressed body may decode to: a stored body is at
/// most `max_response_body`, and a decompression bomb must not take the
/// server's memory.
const DECODED_LIMIT_FACTOR: usize = 64;

/// What to do with a replay's body, given the replaying request.
pub(crate) enum Replay {
    /// The body can be sent as stored.
    AsStored,
    /// The body was decoded to this; drop `Content-Encoding`.
    Decoded(Bytes),
    /// The stored coding is neither accepted nor decodable.
    NotAcceptable(String),
}

/// Decides how to replay `body`, stored with `headers`, to a request that
/// sent `accept` (its `Accept-Encoding`, if any).
///
/// A request without `Accept-Encoding` is taken to accept only `identity`
/// (RFC 9110 allows any coding then, but clients that send none, such as
/// curl without `--compressed`, generally cannot decode one).
pub(crate) fn negotiate(
    headers: &HeaderMap,
    body: &Bytes,
    accept: Option<&HeaderValue>,
    max_body: usize,
) -> Replay {
    let codings: Vec<String> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    if codings.is_empty() {
        return Replay::AsStored;
    }
    let accept = accept.and_then(|v| v.to_str().ok()).unwrap_or("");
    if codings.iter().all(|c| accepts(accept, c)) {
        return Replay::AsStored;
    }
    let limit = max_body.saturating_mul(DECODED_LIMIT_FACTOR);
    // Codings apply in the order listed; undo them from the last.
    let mut decoded = body.to_vec();
    for coding in codings.iter().rev() {
        decoded = match decode(coding, &decoded, limit) {
            Ok(d) => d,
            Err(why) => return Replay::NotAcceptable(why),
        };
    }
    Replay::Decoded(Bytes::from(decoded))
}

/// Whether an `Accept-Encoding` value accepts `coding` (q > 0, by name or `*`).
fn accepts(accept: &str, coding: &str) -> bool {
    let name = |c: &str| if c == "x-gzip" { "gzip" } else { c }.to_owned();
    let want = name(coding);
    let mut star = None;
    for item in accept.split(',') {
        let mut params = item.split(';');
        let Some(token) = params.next().map(|t| t.trim().to_ascii_lowercase()) else {
            continue;
        };
        let q_positive = params
            .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
            .next()
            .is_none_or(|q| q.trim().parse::<f32>().is_ok_and(|q| q > 0.0));
        if token == "*" {
            star = Some(q_positive);
        } else if name(&token) == want {
            return q_positive;
        }
    }
    star.unwrap_or(false)
}

fn decode(coding: &str, data: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    let read_limited = |reader: &mut dyn Read| -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
        reader
            .take(cap)
            .read_to_end(&mut out)
            .map_err(|e| format!("the stored {coding} body does not decode: {e}"))?;
        if out.len() > limit {
            return Err(format!(
                "the stored {coding} body decodes to over {limit} bytes"
            ));
        }
        Ok(out)
    };
    match coding {
        "gzip" | "x-gzip" => read_limited(&mut flate2::read::MultiGzDecoder::new(data)),
        // HTTP's "deflate" is the zlib format (RFC 9110 §8.4.1.2).
        "deflate" => read_limited(&mut flate2::read::ZlibDecoder::new(data)),
        other => Err(format!(
            "the stored response is encoded with {other:?}, which this request does not accept and the layer cannot decode"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Bytes {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        Bytes::from(e.finish().unwrap())
    }

    fn headers(coding: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
        h
    }

    #[test]
    fn accept_encoding_forms() {
        assert!(accepts("gzip", "gzip"));
        assert!(accepts("deflate, GZIP;q=0.5", "gzip"));
        assert!(accepts("x-gzip", "gzip"));
        assert!(accepts("*", "br"));
        assert!(!accepts("gzip;q=0", "gzip"));
        assert!(!accepts("*;q=0", "gzip"));
        assert!(!accepts("gzip;q=0, *", "gzip"));
        assert!(!accepts("", "gzip"));
        assert!(!accepts("br", "gzip"));
    }

    #[test]
    fn decodes_what_is_not_accepted() {
        let body = gzip(b"{\"ok\":true}");
        let h = headers("gzip");
        let gz = HeaderValue::from_static("gzip, br");
        assert!(matches!(
            negotiate(&h, &body, Some(&gz), 1024),
            Replay::AsStored
        ));
        match negotiate(&h, &body, None, 1024) {
            Replay::Decoded(d) => assert_eq!(&d[..], b"{\"ok\":true}"),
            _ => panic!("expected a decoded body"),
        }
        assert!(matches!(
            negotiate(&headers("br"), &body, None, 1024),
            Replay::NotAcceptable(_)
        ));
        assert!(matches!(
            negotiate(&HeaderMap::new(), &body, None, 1024),
            Replay::AsStored
        ));
    }

    #[test]
    fn decompression_bombs_are_refused() {
        let body = gzip(&vec![0u8; 100_000]);
        assert!(matches!(
            negotiate(&headers("gzip"), &body, None, 1000),
            Replay::NotAcceptable(_)
        ));
    }
}
