//! The `Idempotency-Key` request header: parsing and validation.

use http::{HeaderMap, HeaderValue};
use std::fmt;

/// Longest accepted key, in bytes (after unquoting); the grammar's, from
/// `idem-key`, which `idem-client` shares.
pub use idem_key::{KeyError, MAX_KEY_LEN};

/// Why an `Idempotency-Key` header was refused (answered with `400`).
///
/// ```
/// use idem_http::{parse_idempotency_key, KeyError, KeyHeaderError};
/// let bad = http::HeaderValue::from_static("\"unterminated");
/// assert_eq!(
///     parse_idempotency_key(&bad),
///     Err(KeyHeaderError::Invalid(KeyError::Unterminated))
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The value breaks the key grammar (`idem-key`'s, which `idem-client`
    /// shares): empty, only spaces, over [`MAX_KEY_LEN`] bytes, not
    /// printable ASCII, a space in a bare token, a bad escape, an
    /// unterminated quote, characters after it. The grammar's error says
    /// which, and what to send instead.
    #[error(transparent)]
    Invalid(#[from] KeyError),
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
            Err(_) => Err(KeyHeaderError::Invalid(KeyError::NotPrintable {
                byte: 0,
                at: 0,
            })),
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
        assert_eq!(parse(b""), Err(KeyHeaderError::Invalid(KeyError::Empty)));
        assert_eq!(
            parse(b"\"\""),
            Err(KeyHeaderError::Invalid(KeyError::Empty))
        );
        assert_eq!(
            parse(b"\"  \""),
            Err(KeyHeaderError::Invalid(KeyError::OnlySpaces))
        );
        assert_eq!(
            parse(b"a b"),
            Err(KeyHeaderError::Invalid(KeyError::SpaceInToken))
        );
        assert_eq!(
            parse(b"\"abc"),
            Err(KeyHeaderError::Invalid(KeyError::Unterminated))
        );
        assert_eq!(
            parse(b"\"abc\\"),
            Err(KeyHeaderError::Invalid(KeyError::Unterminated))
        );
        assert_eq!(
            parse(b"\"a\\nb\""),
            Err(KeyHeaderError::Invalid(KeyError::BadEscape { at: 2 }))
        );
        assert_eq!(
            parse(b"\"a\";x=1"),
            Err(KeyHeaderError::Invalid(KeyError::TrailingCharacters))
        );
        assert!(matches!(
            parse("clé".as_bytes()),
            Err(KeyHeaderError::Invalid(KeyError::NotPrintable {
                byte: 0xc3,
                at: 2
            }))
        ));
        assert!(matches!(
            parse(b"a\tb"),
            Err(KeyHeaderError::Invalid(KeyError::NotPrintable {
                byte: b'\t',
                at: 1
            }))
        ));
        assert_eq!(parse(&[b'k'; 255]).map(|k| k.len()), Ok(255));
        assert_eq!(
            parse(&[b'k'; 256]),
            Err(KeyHeaderError::Invalid(KeyError::TooLong { len: 256 }))
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
