//! # idem-key
//!
//! The `Idempotency-Key` grammar, defined once for idem's HTTP client
//! (`idem-client`, which encodes keys) and server (`idem-http`, which
//! decodes them), so that idem's client can never send a key idem's server
//! refuses, nor one it reads differently.
//!
//! **A key** is 1 to [`MAX_KEY_LEN`] characters of printable ASCII
//! (`0x20..=0x7E`, spaces included) that are not all spaces: exactly the
//! values of a Structured Field String (RFC 9651 §3.3.3), bounded.
//!
//! **On the wire** a key is one of:
//!
//! * a *bare token*: visible ASCII (`0x21..=0x7E`) not starting with `"`,
//!   such as a UUID — what most clients send;
//! * a *Structured Field String*: `"…"` with `\"` and `\\` as the only
//!   escapes, as the IETF Idempotency-Key draft defines the header.
//!
//! Both forms of the same characters are the same key. Spaces and tabs
//! around the value are ignored; parameters (`"k";p=1`) are refused.
//! [`encode`] picks the bare form whenever it can (servers that predate the
//! draft understand it) and the string form otherwise (spaces, a leading
//! `"`), and [`decode`] of what [`encode`] gives is always the key.
//!
//! ```
//! use idem_key::{decode, encode};
//!
//! assert_eq!(encode("5f0c7a3e-1c2b").unwrap(), "5f0c7a3e-1c2b");
//! assert_eq!(encode(" a b ").unwrap(), r#"" a b ""#);
//! assert_eq!(decode(br#"" a b ""#).unwrap(), " a b ");
//! assert_eq!(decode(b"5f0c7a3e-1c2b").unwrap(), decode(br#""5f0c7a3e-1c2b""#).unwrap());
//! assert!(encode("tab\there").is_err());
//! ```
//!
//! ## What else a key comes with
//!
//! Besides its grammar, the crate holds the rest of what the crates on both
//! sides of a key must agree on, each defined once:
//!
//! * **its key space**, [`scope`]: the scope a server layer stores a key
//!   under (its own scope plus the request's tenant, by default a digest of
//!   the credentials), the same for idem's HTTP and gRPC layers, so one
//!   client's key never answers another tenant's request;
//! * **its lifetime limits**, [`MIN_DURATION`], [`MAX_TTL`] and
//!   [`MAX_LEASE`]: how long a key's result and its lease may be kept. The
//!   runtime (`idem-core`, which re-exports them) refuses other values at
//!   run time and the `#[idempotent]` macro (`idem-macros`) refuses literal
//!   ones at compile time; this crate is the one both depend on (a
//!   proc-macro crate depending on the runtime would compile it for the
//!   host);
//! * **how a key is re-sent**, [`RetryPolicy`]: every retry of idem's
//!   clients re-sends the same key, on one schedule for the HTTP client
//!   (`idem-client`, re-exported as `idem_client::RetryPolicy`) and the
//!   gRPC client (`idem_grpc::client::RetryPolicy`); those two share no
//!   other crate but the runtime, and the gRPC client must not depend on
//!   the HTTP one (reqwest).

mod limits;
mod retry;
pub mod scope;

pub use retry::RetryPolicy;

pub use limits::{MAX_LEASE, MAX_TTL, MIN_DURATION};

use std::borrow::Cow;

/// Longest key, in bytes (after unquoting). Keys are ASCII, so also in
/// characters.
///
/// ```
/// assert!(idem_key::validate(&"k".repeat(idem_key::MAX_KEY_LEN)).is_ok());
/// assert!(idem_key::validate(&"k".repeat(idem_key::MAX_KEY_LEN + 1)).is_err());
/// ```
pub const MAX_KEY_LEN: usize = 255;

/// Why a key, or an `Idempotency-Key` header value, is refused.
///
/// ```
/// use idem_key::{decode, KeyError};
/// assert_eq!(decode(b"\"unterminated"), Err(KeyError::Unterminated));
/// assert_eq!(decode(b"a b"), Err(KeyError::SpaceInToken));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty (or the header holds nothing, or `""`).
    #[error(
        "the Idempotency-Key is empty; send 1 to {MAX_KEY_LEN} printable ASCII characters, e.g. a UUID"
    )]
    Empty,
    /// Only spaces: almost certainly a key that was never filled in.
    #[error("the Idempotency-Key is only spaces; send a unique value per operation, e.g. a UUID")]
    OnlySpaces,
    /// Longer than [`MAX_KEY_LEN`] bytes.
    #[error(
        "the Idempotency-Key is {len} bytes, over the {MAX_KEY_LEN}-byte limit; hash long values (e.g. SHA-256 hex)"
    )]
    TooLong {
        /// Length of the key in bytes.
        len: usize,
    },
    /// A byte that is not printable ASCII (a control character such as a
    /// tab, or a byte over 0x7E such as part of a UTF-8 sequence).
    #[error(
        "the Idempotency-Key contains a byte that is not printable ASCII (0x{byte:02x} at offset {at}); use printable ASCII, e.g. a UUID"
    )]
    NotPrintable {
        /// The offending byte.
        byte: u8,
        /// Its offset (in the key, or in the header value when decoding).
        at: usize,
    },
    /// A bare (unquoted) header value containing a space: quote it.
    #[error(
        "the Idempotency-Key contains a space; keys with spaces must be sent as a quoted string (\"...\")"
    )]
    SpaceInToken,
    /// A quoted value with a backslash followed by something other than `"`
    /// or `\`.
    #[error(
        "the quoted Idempotency-Key has an invalid escape at offset {at}; only \\\" and \\\\ are allowed"
    )]
    BadEscape {
        /// Offset of the backslash in the header value.
        at: usize,
    },
    /// A quoted value without its closing quote.
    #[error("the quoted Idempotency-Key has no closing quote")]
    Unterminated,
    /// Something after the closing quote (parameters are not supported).
    #[error(
        "the quoted Idempotency-Key has characters after its closing quote; send the key alone"
    )]
    TrailingCharacters,
}

/// Checks a key (the value itself, not its header form).
///
/// ```
/// assert!(idem_key::validate("order-42 charge").is_ok());
/// assert_eq!(idem_key::validate(""), Err(idem_key::KeyError::Empty));
/// assert_eq!(idem_key::validate("   "), Err(idem_key::KeyError::OnlySpaces));
/// ```
pub fn validate(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if let Some((at, byte)) = key.bytes().enumerate().find(|(_, b)| !is_printable(*b)) {
        return Err(KeyError::NotPrintable { byte, at });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    if key.bytes().all(|b| b == b' ') {
        return Err(KeyError::OnlySpaces);
    }
    Ok(())
}

/// The header value that carries `key`: the key itself when it is a bare
/// token, else the key as a Structured Field String.
///
/// ```
/// assert_eq!(idem_key::encode("abc").unwrap(), "abc");
/// assert_eq!(idem_key::encode(r#"say "hi""#).unwrap(), r#""say \"hi\"""#);
/// assert_eq!(idem_key::encode(r#""quoted""#).unwrap(), r#""\"quoted\"""#);
/// ```
pub fn encode(key: &str) -> Result<Cow<'_, str>, KeyError> {
    validate(key)?;
    if is_bare_token(key.as_bytes()) {
        return Ok(Cow::Borrowed(key));
    }
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Ok(Cow::Owned(out))
}

/// The key carried by one `Idempotency-Key` header value (its bytes).
///
/// ```
/// use idem_key::decode;
/// assert_eq!(decode(b"  abc\t").unwrap(), "abc");
/// assert_eq!(decode(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
/// assert!(decode(br#""a";p=1"#).is_err());
/// ```
pub fn decode(value: &[u8]) -> Result<String, KeyError> {
    let start = value
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    let trimmed = value.get(start..end).unwrap_or_default();
    if let Some((at, &byte)) = trimmed.iter().enumerate().find(|(_, b)| !is_printable(**b)) {
        return Err(KeyError::NotPrintable {
            byte,
            at: at + start,
        });
    }
    let key = match trimmed.first() {
        None => return Err(KeyError::Empty),
        Some(b'"') => unquote(trimmed, start)?,
        Some(_) => {
            if trimmed.contains(&b' ') {
                return Err(KeyError::SpaceInToken);
            }
            // All bytes are printable ASCII, checked above.
            trimmed.iter().map(|&b| char::from(b)).collect()
        }
    };
    validate(&key)?;
    Ok(key)
}

fn is_printable(b: u8) -> bool {
    (0x20..=0x7e).contains(&b)
}

/// Sent bare: visible ASCII, and not starting with the string delimiter.
fn is_bare_token(key: &[u8]) -> bool {
    key.first().is_some_and(|&b| b != b'"') && key.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// Unquotes a Structured Field String; `s` starts with `"` and is printable ASCII.
fn unquote(s: &[u8], offset: usize) -> Result<String, KeyError> {
    let mut out = String::with_capacity(s.len());
    let mut i = 1;
    while let Some(&b) = s.get(i) {
        match b {
            b'\\' => match s.get(i + 1) {
                Some(&e @ (b'"' | b'\\')) => {
                    out.push(char::from(e));
                    i += 2;
                }
                Some(_) => return Err(KeyError::BadEscape { at: offset + i }),
                None => return Err(KeyError::Unterminated),
            },
            b'"' => {
                return if i + 1 == s.len() {
                    Ok(out)
                } else {
                    Err(KeyError::TrailingCharacters)
                };
            }
            b => {
                out.push(char::from(b));
                i += 1;
            }
        }
    }
    Err(KeyError::Unterminated)
}
