//! The `Idempotency-Key` request header: parsing and validation.

use http::{HeaderMap, HeaderValue};
use std::fmt;

/// Longest accepted key, in bytes (after unquoting); the grammar's, from
/// `idem-key`, which `idem-client` shares.
pub use idem_key::MAX_KEY_LEN;

/// Why an `Idempotency-Key` header was refused (answered with `400`).
///
/// ```
/// use idem_http::{parse_idempotency_key, KeyHeaderError};
/// let bad = http::HeaderValue::from_static("\"unterminated");
/// assert_eq!(parse_idempotency_key(&bad), Err(KeyHeaderError::Unterminated));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The header is present but holds nothing (or `""`).
    #[error(
        "the Idempotency-Key header is empty; send 1 to {MAX_KEY_LEN} printable ASCII characters, e.g. a UUID"
    )]
    Empty,
    /// The key is only spaces (almost certainly one never filled in).
    #[error("the Idempotency-Key is only spaces; send a unique value per operation, e.g. a UUID")]
    OnlySpaces,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("the Idempotency-Key is {len} bytes, over the {MAX_KEY_LEN}-byte limit")]
    TooLong {
        /// Length of the key in bytes.
        len: usize,
    },
    /// A byte that is not printable ASCII (a control character, or a byte
    /// over 0x7E such as part of a UTF-8 sequence).
    #[error(
        "the Idempotency-Key contains a byte that is not printable ASCII (0x{byte:02x} at offset {at})"
    )]
    NotPrintable {
        /// The offending byte.
        byte: u8,
        /// Its offset in the header value.
        at: usize,
    },
    /// A bare (unquoted) key containing a space: quote it instead.
    #[error(
        "the Idempotency-Key contains a space; keys with spaces must be sent as a quoted string (\"...\")"
    )]
    SpaceInToken,
    /// A quoted key with a backslash followed by something other than `"` or `\`.
    #[error(
        "the quoted Idempotency-Key has an invalid escape at offset {at}; only \\\" and \\\\ are allowed"
    )]
    BadEscape {
        /// Offset of the backslash in the header value.
        at: usize,
    },
    /// A quoted key without its closing quote.
    #[error("the quoted Idempotency-Key has no closing quote")]
    Unterminated,
    /// Something after the closing quote (parameters are not supported).
    #[error("the quoted Idempotency-Key has characters after its closing quote")]
    TrailingCharacters,
    /// The header was sent more than once.
    #[error("the Idempotency-Key header was sent more than once; send exactly one")]
    Multiple,
}

/// The validated idempotency key of the current request.
///
/// The layer inserts it into the request's extensions before calling the
/// handler, so a handler can read it (for instance to pass it on to a
/// downstream service) with axum's `Extension` extractor.
///
/// ```
/// use axum::Extension;
/// use idem_http::IdempotencyKey;
///
/// async fn handler(Extension(key): Extension<IdempotencyKey>) -> String {
///     format!("your key: {}", key.as_str())
/// }
/// # let _ = handler;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub(crate) String);

impl IdempotencyKey {
    /// The key, unquoted.
    ///
    /// ```
    /// let v = http::HeaderValue::from_static("\"a\\\"b\"");
    /// let key = idem_http::parse_idempotency_key(&v).unwrap();
    /// assert_eq!(key, "a\"b");
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<idem_key::KeyError> for KeyHeaderError {
    fn from(e: idem_key::KeyError) -> Self {
        use idem_key::KeyError as K;
        match e {
            K::Empty => KeyHeaderError::Empty,
            K::OnlySpaces => KeyHeaderError::OnlySpaces,
            K::TooLong { len } => KeyHeaderError::TooLong { len },
            K::NotPrintable { byte, at } => KeyHeaderError::NotPrintable { byte, at },
            K::SpaceInToken => KeyHeaderError::SpaceInToken,
            K::BadEscape { at } => KeyHeaderError::BadEscape { at },
            K::Unterminated => KeyHeaderError::Unterminated,
            K::TrailingCharacters => KeyHeaderError::TrailingCharacters,
            // The grammar's enum is non-exhaustive; a refusal it adds later
            // is still a malformed header.
            _ => KeyHeaderError::Empty,
        }
    }
}

/// Parses one `Idempotency-Key` header value into the key it carries.
///
/// The grammar is `idem-key`'s, shared with `idem-client`, which never
/// sends a key this refuses. Two forms are accepted and mean the same key:
///
/// * a bare token: 1–255 visible ASCII characters (`0x21..=0x7E`), not
///   starting with `"` — for example a UUID;
/// * a Structured Field String (RFC 9651): `"..."` holding printable ASCII
///   (`0x20..=0x7E`), with `\"` and `\\` as the only escapes.
///
/// Surrounding spaces and tabs are ignored. Anything else (invalid UTF-8,
/// control characters, parameters, an empty, all-spaces or over-long key)
/// is an error.
///
/// ```
/// use idem_http::parse_idempotency_key;
/// use http::HeaderValue;
/// let bare = parse_idempotency_key(&HeaderValue::from_static("abc-123")).unwrap();
/// let quoted = parse_idempotency_key(&HeaderValue::from_static("\"abc-123\"")).unwrap();
/// assert_eq!(bare, quoted);
/// assert!(parse_idempotency_key(&HeaderValue::from_static("")).is_err());
/// ```
pub fn parse_idempotency_key(value: &HeaderValue) -> Result<String, KeyHeaderError> {
    idem_key::decode(value.as_bytes()).map_err(KeyHeaderError::from)
}

/// The key of a request: `Ok(None)` when the header is absent.
pub(crate) fn key_from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyHeaderError> {
    let mut values = headers.get_all(crate::IDEMPOTENCY_KEY).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Multiple);
    }
    parse_idempotency_key(first).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<String, KeyHeaderError> {
        match HeaderValue::from_bytes(bytes) {
            Ok(v) => parse_idempotency_key(&v),
            Err(_) => Err(KeyHeaderError::NotPrintable { byte: 0, at: 0 }),
        }
    }

    #[test]
    fn bare_and_quoted_forms() {
        assert_eq!(parse(b"abc").as_deref(), Ok("abc"));
        assert_eq!(parse(b"\"abc\"").as_deref(), Ok("abc"));
        assert_eq!(parse(b"  abc\t").as_deref(), Ok("abc"));
        assert_eq!(parse(br#""a\"b\\c""#).as_deref(), Ok(r#"a"b\c"#));
        assert_eq!(parse(b"\"with space\"").as_deref(), Ok("with space"));
        assert_eq!(parse(b"a=b:c/d").as_deref(), Ok("a=b:c/d"));
        let uuid = "5f0c7a3e-1c2b-4d5e-8f90-0123456789ab";
        assert_eq!(parse(uuid.as_bytes()).as_deref(), Ok(uuid));
    }

    #[test]
    fn refusals() {
        assert_eq!(parse(b""), Err(KeyHeaderError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyHeaderError::Empty));
        assert_eq!(parse(b"\"  \""), Err(KeyHeaderError::OnlySpaces));
        assert_eq!(parse(b"a b"), Err(KeyHeaderError::SpaceInToken));
        assert_eq!(parse(b"\"abc"), Err(KeyHeaderError::Unterminated));
        assert_eq!(parse(b"\"abc\\"), Err(KeyHeaderError::Unterminated));
        assert_eq!(
            parse(b"\"a\\nb\""),
            Err(KeyHeaderError::BadEscape { at: 2 })
        );
        assert_eq!(parse(b"\"a\";x=1"), Err(KeyHeaderError::TrailingCharacters));
        assert!(matches!(
            parse("clé".as_bytes()),
            Err(KeyHeaderError::NotPrintable { byte: 0xc3, at: 2 })
        ));
        assert!(matches!(
            parse(b"a\tb"),
            Err(KeyHeaderError::NotPrintable { byte: b'\t', at: 1 })
        ));
        assert_eq!(parse(&[b'k'; 255]).map(|k| k.len()), Ok(255));
        assert_eq!(
            parse(&[b'k'; 256]),
            Err(KeyHeaderError::TooLong { len: 256 })
        );
        let mut quoted = vec![b'"'];
        quoted.extend([b'k'; 255]);
        quoted.push(b'"');
        assert_eq!(parse(&quoted).map(|k| k.len()), Ok(255));
    }

    #[test]
    fn multiple_headers_are_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(key_from_headers(&h), Ok(None));
        h.append(crate::IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(key_from_headers(&h), Ok(Some("a".to_owned())));
        h.append(crate::IDEMPOTENCY_KEY, HeaderValue::from_static("b"));
        assert_eq!(key_from_headers(&h), Err(KeyHeaderError::Multiple));
    }
}
