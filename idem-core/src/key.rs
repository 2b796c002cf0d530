//! Validation of keys and the layout of the stored key `namespace:scope:key`.

use crate::error::{KeyError, KeyPart};
use std::cell::RefCell;
use std::fmt::{self, Write};
use std::sync::Arc;

/// Longest accepted key, scope or namespace, in bytes: the HTTP key's
/// limit (`idem_key::MAX_KEY_LEN`), so a key that crosses HTTP always fits.
pub const MAX_KEY_LEN: usize = idem_key::MAX_KEY_LEN;

/// Checks one part of a stored key: non-empty, at most 255 bytes, no control
/// characters.
///
/// ```
/// use idem_core::{validate_key_part, KeyPart};
/// assert!(validate_key_part(KeyPart::Key, "order-42").is_ok());
/// assert!(validate_key_part(KeyPart::Key, "a\nb").is_err());
/// ```
pub fn validate_key_part(part: KeyPart, s: &str) -> Result<(), KeyError> {
    if s.is_empty() {
        return Err(KeyError::Empty { part });
    }
    if s.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong {
            part,
            len: s.len(),
            max: MAX_KEY_LEN,
        });
    }
    // Printable ASCII keys (nearly all) pass one branch-free scan; a key
    // with a control byte or any non-ASCII byte gets the char scan, which
    // finds the first control character (C0, DEL and the C1 range).
    let printable = s
        .bytes()
        .fold(true, |ok, b| ok & (b' '..=b'~').contains(&b));
    let at = if printable {
        None
    } else {
        s.char_indices()
            .find(|(_, c)| c.is_control())
            .map(|(at, _)| at)
    };
    match at {
        Some(at) => Err(KeyError::ControlChar { part, at }),
        None => Ok(()),
    }
}

/// Appends `s` with `%` and `:` percent-escaped, so that the first two `:` of
/// a stored key always delimit namespace and scope, whatever the user's key
/// holds: `("a:b", "c")` and `("a", "b:c")` can never meet.
pub(crate) fn push_escaped(out: &mut String, s: &str) {
    // Bytes, not chars: both are ASCII, never part of a longer UTF-8
    // sequence, and a byte scan is a fraction of a char pattern's search.
    if !s.bytes().any(|b| b == b':' || b == b'%') {
        out.push_str(s);
        return;
    }
    for c in s.chars() {
        match c {
            ':' => out.push_str("%3A"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
}

/// Builds `prefix` + escaped scope + `:` + key, checking scope and key.
/// `prefix` is the escaped namespace with its `:`, computed once per builder.
pub(crate) fn storage_key(
    prefix: &str,
    scope: &str,
    key: impl fmt::Display,
) -> Result<String, KeyError> {
    let mut out = String::with_capacity(prefix.len() + scope.len() + 40);
    write_storage_key(&mut out, prefix, scope, key)?;
    Ok(out)
}

/// [`storage_key`], shared: a call and the round trips that carry it
/// refer to one copy. Rendered in a reused per-thread buffer, so the
/// shared copy is the key's one allocation.
pub(crate) fn shared_storage_key(
    prefix: &str,
    scope: &str,
    key: impl fmt::Display,
) -> Result<Arc<str>, KeyError> {
    thread_local! {
        static RENDERED: RefCell<String> = const { RefCell::new(String::new()) };
    }
    RENDERED.with(|buf| match buf.try_borrow_mut() {
        Ok(mut out) => {
            out.clear();
            write_storage_key(&mut out, prefix, scope, &key)?;
            Ok(Arc::from(out.as_str()))
        }
        // A key whose Display renders another key on this thread.
        Err(_) => storage_key(prefix, scope, &key).map(Arc::from),
    })
}

fn write_storage_key(
    out: &mut String,
    prefix: &str,
    scope: &str,
    key: impl fmt::Display,
) -> Result<(), KeyError> {
    validate_key_part(KeyPart::Scope, scope)?;
    out.push_str(prefix);
    push_escaped(out, scope);
    out.push(':');
    let start = out.len();
    // Writing to a String cannot fail; a Display impl that errors yields an
    // empty key, which validation refuses below.
    if write!(out, "{key}").is_err() {
        out.truncate(start);
    }
    validate_key_part(KeyPart::Key, &out[start..])
}

/// What follows a namespace's `:` in the stored key of a failure counter.
/// A record's stored key has a non-empty scope there (`namespace:scope:key`),
/// so `namespace::failures:scope:key` is never a record's key, never matches
/// a scope's scan prefix (`namespace:scope:`), and stays under the
/// namespace's ACL key pattern (`~namespace:*`).
const FAILURES: &str = ":failures:";

/// The stored key of the failure counter kept beside the record at
/// `record_key` (`namespace:scope:key` → `namespace::failures:scope:key`).
/// A key without a namespace (a store used directly) keeps the whole key
/// as the namespace part. The one definition every store uses.
///
/// ```
/// assert_eq!(idem_core::store::failure_key("payments:charge:42"), "payments::failures:charge:42");
/// ```
pub fn failure_key(record_key: &str) -> String {
    let (namespace, rest) = record_key.split_once(':').unwrap_or((record_key, ""));
    let mut out = String::with_capacity(record_key.len() + FAILURES.len() + 1);
    out.push_str(namespace);
    out.push(':');
    out.push_str(FAILURES);
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_keys_never_meet_records() {
        let record = storage_key("ns:", "charge", "42").unwrap();
        assert_eq!(failure_key(&record), "ns::failures:charge:42");
        // A scope named like the marker is escaped in records, so even
        // `failures` as a scope cannot produce a counter's key.
        let tricky = storage_key("ns:", ":failures", "charge:42").unwrap();
        assert_ne!(tricky, failure_key(&record));
        assert!(!failure_key(&record).starts_with("ns:charge:"));
        assert_eq!(failure_key("bare"), "bare::failures:");
    }

    #[test]
    fn scope_and_key_never_collide() {
        let a = storage_key("idem:", "a:b", "c").unwrap();
        let b = storage_key("idem:", "a", "b:c").unwrap();
        assert_ne!(a, b);
        assert_eq!(a, "idem:a%3Ab:c");
        assert_eq!(b, "idem:a:b:c");
    }

    #[test]
    fn refuses_bad_keys() {
        assert!(matches!(
            storage_key("idem:", "s", ""),
            Err(KeyError::Empty { part: KeyPart::Key })
        ));
        assert!(matches!(
            storage_key("idem:", "s", "x".repeat(256)),
            Err(KeyError::TooLong { len: 256, .. })
        ));
        assert!(matches!(
            storage_key("idem:", "s", "a\0b"),
            Err(KeyError::ControlChar { at: 1, .. })
        ));
        assert!(matches!(
            storage_key("idem:", "", "k"),
            Err(KeyError::Empty {
                part: KeyPart::Scope
            })
        ));
        assert!(storage_key("idem:", "s", "x".repeat(255)).is_ok());
        assert!(storage_key("idem:", "s", "{tag} ünï:cödé").is_ok());
        // DEL, and a C1 control after a non-ASCII letter: found where the
        // char scan finds them (byte offsets).
        for (key, at) in [("ab\x7f", 2), ("é\u{85}x", 2), ("~ \t", 2)] {
            assert!(
                matches!(storage_key("idem:", "s", key), Err(KeyError::ControlChar { at: a, .. }) if a == at),
                "{key:?}"
            );
        }
    }
}
