//! Idempotency keys: generation and validation.

use crate::ClientError;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

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
/// A key is 1 to 255 bytes of visible ASCII (`0x20..=0x7E`, so spaces are
/// allowed), and not made only of spaces. The error is
/// [`ClientError::InvalidKey`], which the client returns before sending
/// anything.
///
/// ```
/// use idem_client::{validate_key, ClientError};
///
/// assert!(validate_key("order-42:charge").is_ok());
/// assert!(matches!(validate_key(""), Err(ClientError::InvalidKey { .. })));
/// assert!(validate_key("tab\there").is_err());
/// assert!(validate_key(&"k".repeat(256)).is_err());
/// assert!(validate_key("   ").is_err());
/// ```
pub fn validate_key(key: &str) -> Result<(), ClientError> {
    let invalid = |reason: String| ClientError::InvalidKey {
        key: key.to_owned(),
        reason,
    };
    if key.is_empty() {
        return Err(invalid("it is empty".to_owned()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(invalid(format!(
            "it is {} bytes long and the limit is {MAX_KEY_LEN}",
            key.len()
        )));
    }
    if let Some(pos) = key.bytes().position(|b| !(0x20..=0x7E).contains(&b)) {
        return Err(invalid(format!(
            "byte {pos} is a control or non-ASCII character"
        )));
    }
    if key.bytes().all(|b| b == b' ') {
        return Err(invalid("it is only spaces".to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_edges() {
        assert!(validate_key("a").is_ok());
        assert!(validate_key(&"x".repeat(255)).is_ok());
        assert!(validate_key(" a ").is_ok());
        assert!(validate_key("~!").is_ok());
    }

    #[test]
    fn rejects_bad_keys_with_reasons() {
        for (key, needle) in [
            ("", "empty"),
            ("\u{7f}", "control"),
            ("caf\u{e9}", "non-ASCII"),
            ("a\nb", "byte 1"),
            ("  ", "only spaces"),
        ] {
            match validate_key(key) {
                Err(ClientError::InvalidKey { reason, .. }) => {
                    assert!(reason.contains(needle), "{key:?}: {reason}")
                }
                other => panic!("{key:?}: {other:?}"),
            }
        }
        assert!(validate_key(&"x".repeat(256)).is_err());
    }
}
