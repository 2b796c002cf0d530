//! Owner tokens: who holds a claim.

use std::fmt;

/// A random 128-bit owner token, fresh per claim, written as 32 lowercase hex
/// digits. `complete`, `release` and `extend` act only for the token that
/// holds the record, so a holder that lost its lease cannot overwrite its
/// successor.
///
/// ```
/// use idem_core::Token;
/// let (a, b) = (Token::random(), Token::random());
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

impl Token {
    /// Stands in where no claim is made (a local cache hit): never sent.
    pub(crate) const UNUSED: Token = Token([b'0'; 32]);

    /// A fresh token from the thread-local CSPRNG.
    ///
    /// ```
    /// let t = idem_core::Token::random();
    /// assert!(t.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    /// ```
    pub fn random() -> Token {
        Token::from_u128(rand::random::<u128>())
    }

    /// A token with the given bits (tests and model checks use fixed tokens).
    ///
    /// ```
    /// assert_eq!(idem_core::Token::from_u128(255).as_str(), "000000000000000000000000000000ff");
    /// ```
    pub fn from_u128(bits: u128) -> Token {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = HEX[((bits >> (124 - 4 * i)) & 0xf) as usize];
        }
        Token(out)
    }

    /// The 32 hex digits.
    ///
    /// ```
    /// assert_eq!(idem_core::Token::from_u128(1).as_str().len(), 32);
    /// ```
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written into the array.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// The 32 hex digits as bytes.
    ///
    /// ```
    /// assert_eq!(idem_core::Token::from_u128(0).as_bytes(), &[b'0'; 32]);
    /// ```
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.as_str())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
