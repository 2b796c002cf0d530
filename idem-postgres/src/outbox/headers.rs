//! The outbox table's `headers` column: a message's headers
//! ([`OutboxMessage::headers`](idem_core::outbox::OutboxMessage::headers))
//! as a `json` object of name → string, in their order, or NULL for none.
//!
//! `json`, not `jsonb`: `json` keeps the text as written, so the relay
//! reads back the headers the call stored byte-identical, in their order
//! and with a repeated name kept (`jsonb` sorts an object's keys by length
//! and keeps only the last of a repeated one). It also takes any string
//! (`jsonb` refuses `\u0000`, which would fail the caller's transaction),
//! and costs the insert no conversion. idem never looks inside it;
//! operators still can: `headers->>'traceparent'` works on `json`. An
//! object, not an array of pairs, so that it reads as headers in `psql`.

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
#[cfg(any(feature = "otel", test))]
use serde::{Serialize, Serializer};
use std::fmt;

/// The `headers` value for `headers`: `None` (SQL NULL) when there are
/// none, so a message without headers stores nothing. Only a traced
/// publish (feature `otel`) writes headers.
#[cfg(any(feature = "otel", test))]
pub(crate) fn encode(headers: &[(String, String)]) -> Option<String> {
    if headers.is_empty() {
        return None;
    }
    // A map of strings to strings always serializes; were it ever to fail,
    // the message goes without its trace context rather than failing the
    // caller's transaction.
    match serde_json::to_string(&Object(headers)) {
        Ok(json) => Some(json),
        Err(e) => {
            tracing::warn!(error = %e, "outbox headers could not be written as JSON: stored without");
            None
        }
    }
}

/// The headers in a `headers` value (read as text), or why it is not the
/// object of strings [`encode`] writes. JSON `null` is no headers.
pub(crate) fn decode(json: &str) -> Result<Vec<(String, String)>, String> {
    serde_json::from_str::<Pairs>(json)
        .map(|p| p.0)
        .map_err(|e| e.to_string())
}

/// Headers serialized as one JSON object, in order, repeated names kept.
#[cfg(any(feature = "otel", test))]
struct Object<'a>(&'a [(String, String)]);

#[cfg(any(feature = "otel", test))]
impl Serialize for Object<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(n, v)| (n, v)))
    }
}

/// A JSON object read as its pairs, in order (a map type would lose the
/// order and all but one of a repeated name).
struct Pairs(Vec<(String, String)>);

impl<'de> Deserialize<'de> for Pairs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Pairs, D::Error> {
        d.deserialize_any(PairsVisitor)
    }
}

struct PairsVisitor;

impl<'de> Visitor<'de> for PairsVisitor {
    type Value = Pairs;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object of header names to strings")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Pairs, E> {
        Ok(Pairs(Vec::new()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Pairs, A::Error> {
        let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(2));
        while let Some(pair) = map.next_entry::<String, String>()? {
            pairs.push(pair);
        }
        Ok(Pairs(pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Headers read back as written: order, repeated names, characters
    /// JSON escapes (a quote, a newline, NUL) included.
    #[test]
    fn headers_read_back_in_order_with_repeats() {
        let cases = [
            pairs(&[
                (
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                ),
                ("tracestate", "vnd=abc"),
            ]),
            pairs(&[("k", "first"), ("k", "second"), ("a", "\"\n\0é")]),
        ];
        for headers in cases {
            let json = encode(&headers).unwrap();
            assert_eq!(decode(&json), Ok(headers.clone()), "{json}");
        }
        assert_eq!(
            encode(&pairs(&[("tracestate", "vnd=abc")])).as_deref(),
            Some(r#"{"tracestate":"vnd=abc"}"#)
        );
    }

    /// No headers are stored as NULL; JSON `null` reads as none; any other
    /// shape is an error, never a panic.
    #[test]
    fn none_is_null_and_other_shapes_are_errors() {
        assert_eq!(encode(&[]), None);
        assert_eq!(decode("null"), Ok(Vec::new()));
        assert_eq!(decode("{}"), Ok(Vec::new()));
        for bad in ["[]", "1", r#"{"a":1}"#, r#"{"a":null}"#, r#""x""#, "{", ""] {
            assert!(decode(bad).is_err(), "{bad}");
        }
    }
}
