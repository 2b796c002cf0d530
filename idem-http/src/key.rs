//! The `Idempotency-Key` request header: parsing and validation.

use http::{HeaderMap, HeaderValue};
use std::fmt;

/// Longest accepted key, in bytes (after unquoting).
pub const MAX_KEY_LEN: usize = 255;

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

/// Parses one `Idempotency-Key` header value into the key it carries.
///
/// Two forms are accepted and mean the same key:
///
/// * a bare token: 1–255 visible ASCII characters (`0x21..=0x7E`), not
///   starting with `"` — for example a UUID;
/// * a structured-field string (RFC 8941): `"..."` holding printable ASCII
///   (`0x20..=0x7E`), with `\"` and `\\` as the only escapes.
///
/// Surrounding spaces and tabs are ignored. Anything else (invalid UTF-8,
/// control characters, an empty or over-long key) is an error.
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
    let raw = value.as_bytes();
    let start = raw
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    let trimmed = raw.get(start..end).unwrap_or_default();
    if let Some((at, &byte)) = trimmed
        .iter()
        .enumerate()
        .find(|(_, b)| !(0x20..=0x7e).contains(*b))
    {
        return Err(KeyHeaderError::NotPrintable {
            byte,
            at: at + start,
        });
    }
    let key = match trimmed.first() {
        None => return Err(KeyHeaderError::Empty),
        Some(b'"') => unquote(trimmed, start)?,
        Some(_) => {
            if trimmed.contains(&b' ') {
                return Err(KeyHeaderError::SpaceInToken);
            }
            // All bytes are ASCII, checked above.
            trimmed.iter().map(|&b| char::from(b)).collect()
        }
    };
    if key.is_empty() {
        return Err(KeyHeaderError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyHeaderError::TooLong { len: key.len() });
    }
    Ok(key)
}

/// Unquotes a structured-field string; `s` starts with `"` and is printable ASCII.
fn unquote(s: &[u8], offset: usize) -> Result<String, KeyHeaderError> {
    let mut out = String::with_capacity(s.len());
    let mut i = 1;
    while let Some(&b) = s.get(i) {
        match b {
            b'\\' => match s.get(i + 1) {
                Some(&e @ (b'"' | b'\\')) => {
                    out.push(char::from(e));
                    i += 2;
                }
                Some(_) => return Err(KeyHeaderError::BadEscape { at: offset + i }),
                None => return Err(KeyHeaderError::Unterminated),
            },
            b'"' => {
                return if i + 1 == s.len() {
                    Ok(out)
                } else {
                    Err(KeyHeaderError::TrailingCharacters)
                };
            }
            b => {
                out.push(char::from(b));
                i += 1;
            }
        }
    }
    Err(KeyHeaderError::Unterminated)
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
