//! Idempotency keys: generation and validation.

use crate::ClientError;

/// Name of the request header carrying the idempotency key.
///
/// ```
/// assert_eq!(idem_client::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Longest key accepted, in bytes: the grammar's, from `idem-key`, which
/// idem's server (`idem-http`) shares.
pub use idem_key::MAX_KEY_LEN;

/// A fresh key for a new logical operation: a random (version 4) UUID in its
/// hyphenated lowercase form.
///
/// ```
/// let key = idem_client::new_key();
/// assert_eq!(key.len(), 36);
/// assert!(idem_client::validate_key(&key).is_ok());
/// assert_ne!(key, idem_client::new_key());
/// ```
pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Checks a caller-supplied idempotency key.
///
/// A key is 1 to 255 bytes of printable ASCII (`0x20..=0x7E`, so spaces are
/// allowed), and not made only of spaces: the grammar of `idem-key`, which
/// idem's server (`idem-http`) parses with, so a key this accepts is never
/// refused there. The error is [`ClientErrorKind::InvalidKey`](crate::ClientErrorKind::InvalidKey), which the
/// client returns before sending anything.
///
/// A key that is not a bare token (it has a space, or starts with `"`) is
/// sent as a quoted Structured Field String (`"a b"`); the server reads both
/// forms as the same key.
///
/// ```
/// use idem_client::{validate_key, ClientErrorKind};
///
/// assert!(validate_key("order-42:charge").is_ok());
/// assert!(validate_key(" spaced key ").is_ok());
/// let err = validate_key("").unwrap_err();
/// assert!(matches!(err.kind(), ClientErrorKind::InvalidKey { .. }));
/// assert!(validate_key("tab\there").is_err());
/// assert!(validate_key(&"k".repeat(256)).is_err());
/// assert!(validate_key("   ").is_err());
/// ```
pub fn validate_key(key: &str) -> Result<(), ClientError> {
    header_value(key).map(drop)
}

/// The `Idempotency-Key` header value carrying `key` (bare, or quoted when
/// it must be), or why the key is refused.
pub(crate) fn header_value(key: &str) -> Result<http::HeaderValue, ClientError> {
    let invalid = |reason: String| ClientError::invalid_key(key, reason);
    let encoded = idem_key::encode(key).map_err(|e| invalid(e.to_string()))?;
    // Printable ASCII only, so a valid header value.
    http::HeaderValue::from_str(&encoded).map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClientErrorKind;

    #[test]
    fn accepts_edges() {
        assert!(validate_key("a").is_ok());
        assert!(validate_key(&"x".repeat(255)).is_ok());
        assert!(validate_key(" a ").is_ok());
        assert!(validate_key("~!").is_ok());
        assert!(validate_key("\"quoted\"").is_ok());
    }

    #[test]
    fn keys_are_sent_bare_or_quoted() {
        assert_eq!(header_value("abc").unwrap(), "abc");
        assert_eq!(header_value(" a b ").unwrap(), "\" a b \"");
        assert_eq!(header_value("\"x").unwrap(), "\"\\\"x\"");
    }

    #[test]
    fn rejects_bad_keys_with_reasons() {
        for (key, needle) in [
            ("", "empty"),
            ("\u{7f}", "0x7f at offset 0"),
            ("caf\u{e9}", "not printable ASCII"),
            ("a\nb", "offset 1"),
            ("  ", "only spaces"),
        ] {
            match validate_key(key) {
                Err(err) => match err.kind() {
                    ClientErrorKind::InvalidKey { reason, .. } => {
                        assert!(reason.contains(needle), "{key:?}: {reason}")
                    }
                    other => panic!("{key:?}: {other:?}"),
                },
                other => panic!("{key:?}: {other:?}"),
            }
        }
        assert!(validate_key(&"x".repeat(256)).is_err());
    }
}
