//! Keys derived from a payload: canonical JSON (object keys sorted), with
//! volatile fields removed, hashed with SHA-256.
//!
//! A message or request that carries no id of its own can still be made
//! idempotent: two copies of the same payload get the same key, even when a
//! producer re-serialized it with another key order or stamped it with a new
//! timestamp or trace id (list those as excluded JSON pointers).

mod canon;
mod order;
mod plain;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Why a key could not be derived from a payload.
///
/// ```
/// use idem_core::{DeriveError, KeyDeriver};
///
/// let bad = KeyDeriver::new().exclude("sent_at"); // no leading '/'
/// assert_eq!(bad, Err(DeriveError::BadPointer("sent_at".into())));
/// let err = KeyDeriver::new().derive(b"not json").unwrap_err();
/// assert!(matches!(err, DeriveError::NotJson(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeriveError {
    /// The payload is not JSON, so it has no canonical form.
    #[error(
        "the payload is not valid JSON ({0}), so no key can be derived from it; \
         send JSON, or key these messages on a message id instead"
    )]
    NotJson(String),
    /// An excluded field is not a JSON pointer.
    #[error(
        "`{0}` is not a JSON pointer; write excluded fields as RFC 6901 pointers such as `/meta/sent_at`"
    )]
    BadPointer(String),
}

/// Derives keys from JSON payloads: canonical form (object keys sorted, no
/// insignificant whitespace), minus excluded fields, hashed with SHA-256 and
/// rendered as 64 lowercase hex digits (always a valid idem key).
///
/// ```
/// use idem_core::KeyDeriver;
///
/// let d = KeyDeriver::new().exclude("/sent_at")?.exclude("/meta/trace_id")?;
/// let a = d.derive(br#"{"order":7,"amount":500,"sent_at":"10:00","meta":{"trace_id":"x"}}"#)?;
/// let b = d.derive(br#"{ "amount": 500, "order": 7, "sent_at": "10:05", "meta": {"trace_id": "y"} }"#)?;
/// assert_eq!(a, b);                 // same order, re-sent later: same key
/// assert_eq!(a.len(), 64);
/// assert_ne!(a, d.derive(br#"{"order":7,"amount":501}"#)?);
/// assert!(d.derive(b"not json").is_err());
/// # Ok::<(), idem_core::DeriveError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyDeriver {
    /// Each pointer split into its unescaped reference tokens.
    excluded: Vec<Vec<String>>,
}

impl KeyDeriver {
    /// A deriver that keeps every field.
    pub fn new() -> KeyDeriver {
        KeyDeriver::default()
    }

    /// Leaves the field at `pointer` (RFC 6901, e.g. `/meta/sent_at`, or
    /// `/items/0/ts` inside an array) out of the key. A pointer that matches
    /// nothing in a payload is ignored there.
    ///
    /// ```
    /// assert!(idem_core::KeyDeriver::new().exclude("sent_at").is_err()); // missing the leading '/'
    /// ```
    pub fn exclude(mut self, pointer: &str) -> Result<KeyDeriver, DeriveError> {
        self.excluded.push(parse_pointer(pointer)?);
        Ok(self)
    }

    /// The canonical bytes of `payload` that the key hashes: sorted keys,
    /// excluded fields removed.
    ///
    /// ```
    /// let d = idem_core::KeyDeriver::new().exclude("/ts")?;
    /// assert_eq!(d.canonical(br#"{"b":1,"a":[true,null],"ts":9}"#)?, br#"{"a":[true,null],"b":1}"#);
    /// # Ok::<(), idem_core::DeriveError>(())
    /// ```
    pub fn canonical(&self, payload: &[u8]) -> Result<Vec<u8>, DeriveError> {
        if self.excluded.is_empty() {
            // Nothing to remove: written while parsed, without a tree.
            return canon::canonical(payload).map_err(|e| DeriveError::NotJson(e.to_string()));
        }
        let mut value: Value =
            serde_json::from_slice(payload).map_err(|e| DeriveError::NotJson(e.to_string()))?;
        for pointer in &self.excluded {
            remove_at(&mut value, pointer);
        }
        Ok(canonical_json(&value))
    }

    /// The key of `payload`: 64 hex digits of SHA-256 over its canonical form.
    pub fn derive(&self, payload: &[u8]) -> Result<String, DeriveError> {
        Ok(KeyDeriver::key_of_digest(&self.digest(payload)?))
    }

    /// The key a [`digest`](KeyDeriver::digest) stands for: its 64 lowercase
    /// hex digits, what [`derive`](KeyDeriver::derive) returns. For a caller
    /// that needs the digest too (as a fingerprint) and so hashes once.
    ///
    /// ```
    /// let d = idem_core::KeyDeriver::new();
    /// let digest = d.digest(br#"{"a":1}"#)?;
    /// assert_eq!(idem_core::KeyDeriver::key_of_digest(&digest), d.derive(br#"{"a":1}"#)?);
    /// # Ok::<(), idem_core::DeriveError>(())
    /// ```
    pub fn key_of_digest(digest: &[u8; 32]) -> String {
        // By table into a buffer, then one copy: `hex::encode` collects
        // chars into a growing String, ten times the work.
        let mut hex = [0u8; 64];
        match hex::encode_to_slice(digest, &mut hex) {
            Ok(()) => std::str::from_utf8(&hex).unwrap_or_default().to_owned(),
            // 32 bytes always fill 64 digits.
            Err(_) => String::new(),
        }
    }

    /// The raw SHA-256 of the canonical form (for a fingerprint, for example
    /// with [`Fingerprint::from_sha256`](crate::Fingerprint::from_sha256)).
    ///
    /// ```
    /// let d = idem_core::KeyDeriver::new();
    /// let f = idem_core::Fingerprint::from_sha256(d.digest(br#"{"a":1}"#)?);
    /// assert_eq!(f, idem_core::Fingerprint::from_sha256(d.digest(br#"{ "a" : 1 }"#)?));
    /// # Ok::<(), idem_core::DeriveError>(())
    /// ```
    pub fn digest(&self, payload: &[u8]) -> Result<[u8; 32], DeriveError> {
        if self.excluded.is_empty() {
            return canon::digest(payload).map_err(|e| DeriveError::NotJson(e.to_string()));
        }
        Ok(Sha256::digest(self.canonical(payload)?).into())
    }
}

fn parse_pointer(pointer: &str) -> Result<Vec<String>, DeriveError> {
    // The empty pointer means the whole document: excluding it would make
    // every payload share one key, which is never what anyone wants.
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(DeriveError::BadPointer(pointer.to_owned()));
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn remove_at(value: &mut Value, tokens: &[String]) {
    let Some((last, parents)) = tokens.split_last() else {
        return;
    };
    let mut at = value;
    for token in parents {
        let next = match at {
            Value::Object(map) => map.get_mut(token.as_str()),
            Value::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(v) => at = v,
            None => return,
        }
    }
    match at {
        Value::Object(map) => {
            map.remove(last.as_str());
        }
        Value::Array(items) => {
            if let Ok(i) = last.parse::<usize>()
                && i < items.len()
            {
                items.remove(i);
            }
        }
        _ => {}
    }
}

/// Writes `value` with object keys sorted by their UTF-8 bytes, whatever
/// map type serde_json was built with (its `preserve_order` feature may be
/// on elsewhere in the dependency graph).
fn canonical_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let _ = serde_json::to_writer(&mut *out, k);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => write_scalar(scalar, out),
    }
}

fn write_scalar(value: &Value, out: &mut Vec<u8>) {
    // Serializing a string, number, bool or null into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_lowercase_hex_of_the_digest() {
        // SHA-256 of `{}`, the canonical form of an empty object.
        assert_eq!(
            KeyDeriver::new().derive(b"{ }").unwrap(),
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
    }

    #[test]
    fn nested_objects_sort_and_pointers_unescape() {
        let d = KeyDeriver::new()
            .exclude("/a~1b")
            .unwrap()
            .exclude("/x/0/t")
            .unwrap();
        let c = d
            .canonical(br#"{"z":{"b":1,"a":2},"a/b":3,"x":[{"t":1,"u":2}]}"#)
            .unwrap();
        assert_eq!(c, br#"{"x":[{"u":2}],"z":{"a":2,"b":1}}"#);
    }

    #[test]
    fn pointers_into_scalars_or_missing_paths_are_ignored() {
        let d = KeyDeriver::new()
            .exclude("/a/b/c")
            .unwrap()
            .exclude("/n/9")
            .unwrap();
        assert_eq!(
            d.canonical(br#"{"a":1,"n":[1]}"#).unwrap(),
            br#"{"a":1,"n":[1]}"#
        );
        assert_eq!(d.canonical(b"17").unwrap(), b"17");
    }

    #[test]
    fn bad_input_is_typed() {
        let d = KeyDeriver::new();
        assert!(matches!(d.derive(b""), Err(DeriveError::NotJson(_))));
        assert!(matches!(
            d.derive(&[0xff, 0xfe]),
            Err(DeriveError::NotJson(_))
        ));
        assert!(matches!(
            KeyDeriver::new().exclude(""),
            Err(DeriveError::BadPointer(_))
        ));
    }
}
