//! The canonical form written while the payload is parsed: no tree of
//! `Value`s, no string copied but keys. A plain document (no escape, no
//! float) is written by a scan of its bytes ([`plain`](super::plain));
//! any other by serde_json's visits. An object whose keys arrive sorted is
//! written in place; one whose keys do not is re-ordered once its entries
//! are written.
//!
//! The bytes are exactly those of sorting a parsed `serde_json::Value`: the
//! same visits (numbers as `u64`/`i64`/`f64`, strings) serialized by the
//! same serializer, and a key given twice keeps its last value.

use super::order::{Entry, write_in_order};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::fmt;

/// The canonical form of the JSON document in `payload`.
pub(super) fn canonical(payload: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(payload.len());
    canonical_into(&mut out, &mut Scratch::default(), payload)?;
    Ok(out)
}

/// SHA-256 of the canonical form of `payload`, written in buffers this
/// thread keeps: a fingerprint per message allocates nothing.
pub(super) fn digest(payload: &[u8]) -> Result<[u8; 32], serde_json::Error> {
    thread_local! {
        static BUFFERS: RefCell<(Vec<u8>, Scratch)> = const {
            RefCell::new((Vec::new(), Scratch { keys: Vec::new(), entries: Vec::new() }))
        };
    }
    BUFFERS.with(|buffers| match buffers.try_borrow_mut() {
        Ok(mut buffers) => {
            let (out, scratch) = &mut *buffers;
            out.clear();
            let done = canonical_into(out, scratch, payload).map(|()| Sha256::digest(&*out).into());
            // A huge payload's buffers are not kept for the thread's life.
            if out.capacity() + scratch.keys.capacity() > KEPT
                || scratch.entries.capacity() > KEPT / 16
            {
                *buffers = (Vec::new(), Scratch::default());
            }
            done
        }
        Err(_) => canonical(payload).map(|out| Sha256::digest(out).into()),
    })
}

/// The most bytes [`digest`] keeps between payloads.
const KEPT: usize = 64 << 10;

/// Appends the canonical form of `payload` to `out`.
fn canonical_into(
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
    payload: &[u8],
) -> Result<(), serde_json::Error> {
    let written = out.len();
    scratch.entries.clear();
    if super::plain::canonical_into(out, &mut scratch.entries, payload) {
        return Ok(());
    }
    out.truncate(written);
    by_visits(out, scratch, payload)
}

/// [`canonical_into`] for any document: each value visited by serde_json.
fn by_visits(
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
    payload: &[u8],
) -> Result<(), serde_json::Error> {
    scratch.keys.clear();
    scratch.entries.clear();
    let mut de = serde_json::Deserializer::from_slice(payload);
    Canon { out, scratch }.deserialize(&mut de)?;
    de.end()
}

/// What the objects being written keep of their entries, in stacks shared
/// by nested objects (each pops its own off when done): no allocation per
/// object, nor per escaped key.
#[derive(Default)]
struct Scratch {
    /// The keys, unescaped, one after the other.
    keys: Vec<u8>,
    /// Each entry: its key in `keys`, and where it was written.
    entries: Vec<Entry>,
}

/// Writes the canonical form of the next value at the end of its buffer.
struct Canon<'o> {
    out: &'o mut Vec<u8>,
    scratch: &'o mut Scratch,
}

impl Canon<'_> {
    fn scalar<T: serde::Serialize + ?Sized>(self, v: &T) {
        // A string, number or bool written into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *self.out, v);
    }
}

impl<'de> DeserializeSeed<'de> for Canon<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Canon<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        self.scalar(&v);
        Ok(())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        self.scalar(&v);
        Ok(())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.scalar(&v);
        Ok(())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        // As `Value` does: a non-finite number (never parsed from JSON) is null.
        match serde_json::Number::from_f64(v) {
            Some(n) => self.scalar(&n),
            None => self.out.extend_from_slice(b"null"),
        }
        Ok(())
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.scalar(v);
        Ok(())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Canon { out, scratch } = self;
        out.push(b'[');
        let mut first = true;
        loop {
            let before = out.len();
            if !first {
                out.push(b',');
            }
            let element = Canon {
                out: &mut *out,
                scratch: &mut *scratch,
            };
            if seq.next_element_seed(element)?.is_none() {
                out.truncate(before);
                break;
            }
            first = false;
        }
        out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Canon { out, scratch } = self;
        out.push(b'{');
        let body = out.len();
        // This object's entries are those above `base`; its keys those
        // above `keys_base`.
        let base = scratch.entries.len();
        let keys_base = scratch.keys.len();
        let mut in_order = true;
        loop {
            let before = out.len();
            let previous = scratch.entries[base..].last().map(|(key, _)| key.clone());
            if previous.is_some() {
                out.push(b',');
            }
            let start = out.len();
            let key_start = scratch.keys.len();
            let key = Key {
                out: &mut *out,
                keys: &mut scratch.keys,
            };
            if map.next_key_seed(key)?.is_none() {
                out.truncate(before);
                break;
            }
            let key = key_start..scratch.keys.len();
            if let Some(previous) = previous {
                // Strictly increasing: sorted, and no key twice.
                in_order &= scratch.keys[previous] < scratch.keys[key.clone()];
            }
            out.push(b':');
            let value = Canon {
                out: &mut *out,
                scratch: &mut *scratch,
            };
            map.next_value_seed(value)?;
            scratch.entries.push((key, start..out.len()));
        }
        if !in_order {
            let Scratch { keys, entries } = &mut *scratch;
            write_in_order(out, body, keys, &mut entries[base..]);
        }
        scratch.entries.truncate(base);
        scratch.keys.truncate(keys_base);
        out.push(b'}');
        Ok(())
    }
}

/// An object's key: written escaped at the end of `out`, and kept
/// unescaped at the end of `keys` (to sort by).
struct Key<'o> {
    out: &'o mut Vec<u8>,
    keys: &'o mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.keys.extend_from_slice(v.as_bytes());
        // A string written into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *self.out, v);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Scratch, by_visits, canonical, digest};
    use proptest::prelude::*;
    use serde_json::Value;
    use sha2::{Digest, Sha256};

    /// The reference: the parsed tree, keys sorted.
    fn by_tree(payload: &[u8]) -> Option<Vec<u8>> {
        let value: Value = serde_json::from_slice(payload).ok()?;
        let mut out = Vec::new();
        super::super::write_canonical(&value, &mut out);
        Some(out)
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "[a-c\\\\\"é\u{1F600}\n/ ]{0,4}".prop_map(Value::from),
        ];
        nested(leaf.boxed(), "[a-c\\\\\"é]{0,3}")
    }

    /// Documents with no float and no character to escape: the plain scan
    /// takes most of them.
    fn plain_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (-1000i64..1000).prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-c\u{e9}\u{1F600}/ ]{0,4}".prop_map(Value::from),
        ];
        nested(leaf.boxed(), "[a-c\u{e9}]{0,3}")
    }

    /// Arrays and objects (keys matching `key`) nested around `leaf`.
    fn nested(leaf: BoxedStrategy<Value>, key: &'static str) -> impl Strategy<Value = Value> {
        leaf.prop_recursive(4, 32, 5, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
                prop::collection::vec((key, inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    /// Objects with keys in a given order, repeated keys included.
    fn written(value: &Value, reversed: bool, out: &mut String) {
        match value {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                if reversed {
                    entries.reverse();
                }
                out.push_str("{ ");
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" ,\n");
                    }
                    out.push_str(&serde_json::to_string(k).unwrap_or_default());
                    out.push_str(" : ");
                    written(v, reversed, out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    written(v, reversed, out);
                }
                out.push(']');
            }
            scalar => out.push_str(&scalar.to_string()),
        }
    }

    proptest! {
        #[test]
        fn same_bytes_as_the_sorted_tree(value in json(), reversed in any::<bool>()) {
            let mut text = String::new();
            written(&value, reversed, &mut text);
            prop_assert_eq!(canonical(text.as_bytes()).ok(), by_tree(text.as_bytes()));
            // The thread's buffers, left as the previous case left them.
            let hashed = by_tree(text.as_bytes()).map(|b| <[u8; 32]>::from(Sha256::digest(b)));
            prop_assert_eq!(digest(text.as_bytes()).ok(), hashed);
        }

        #[test]
        fn same_verdict_on_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..24)) {
            prop_assert_eq!(canonical(&bytes).ok(), by_tree(&bytes));
            prop_assert_eq!(canonical(&bytes).ok(), visited(&bytes));
        }

        /// The scan of plain documents writes what the visits write, or
        /// leaves the document to them: documents as producers write them
        /// (compact, or spaced with keys in reverse), and the same with one
        /// byte changed, added or taken out.
        #[test]
        fn the_plain_scan_writes_what_the_visits_write(
            value in prop_oneof![json(), plain_json()],
            spaced in any::<bool>(),
            edit in (any::<usize>(), 0..3u8, prop_oneof![
                any::<u8>(),
                prop::sample::select(b"{}[],:\"\\ 0-19.eE+tfnu\x01".to_vec()),
            ]),
        ) {
            let mut text = value.to_string();
            if spaced {
                text.clear();
                written(&value, true, &mut text);
            }
            let mut bytes = text.into_bytes();
            prop_assert_eq!(scanned(&bytes).or_else(|| visited(&bytes)), visited(&bytes));
            let (at, how, byte) = edit;
            let at = at % (bytes.len() + 1);
            match how {
                0 if at < bytes.len() => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ if at < bytes.len() => {
                    bytes.remove(at);
                }
                _ => {}
            }
            prop_assert_eq!(scanned(&bytes).or_else(|| visited(&bytes)), visited(&bytes));
        }
    }

    /// The plain scan's canonical form, if it takes the document.
    fn scanned(bytes: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        super::super::plain::canonical_into(&mut out, &mut Vec::new(), bytes).then_some(out)
    }

    /// The canonical form written by serde_json's visits alone.
    fn visited(bytes: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        by_visits(&mut out, &mut Scratch::default(), bytes)
            .ok()
            .map(|()| out)
    }

    #[test]
    fn a_key_given_twice_keeps_its_last_value() {
        for text in [
            &br#"{"b":1,"a":2,"b":3}"#[..],
            br#"{"a":2,"b":1,"b":3}"#,
            br#"{"b":{"y":1,"x":[2, 1.50, -0, 1e400]},"a":"\u00e9\n"}"#,
            br#"  17 "#,
            br#"{"a":1} x"#,
            br#"{"a\"b":1,"a":2}"#,
        ] {
            assert_eq!(
                canonical(text).ok(),
                by_tree(text),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }
}
